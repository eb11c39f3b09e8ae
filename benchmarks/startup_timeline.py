"""Start-up timeline of one ``expertcache`` command: wall and CPU seconds since the process started (from
/proc/self/stat) at the boundaries of its phases (imports, tokenizer + config checks, the skeleton on meta, numba's
kernels, the non-expert weights, the slot arena, the prefill, the first token), by wrapping those functions as
their modules are imported. Prints ``wall cpu event`` lines to stderr or ``$TIMELINE_OUT`` at exit.

    PYTHONPATH=src TIMELINE_OUT=t.txt python benchmarks/startup_timeline.py generate --model /work/peers/L8 \
        --quant q4 --policy cache-prior --memory 3GiB --threads 1 --max-new-tokens 1 "x"

BENCHMARKS.md "Start-up" has the figures."""
import os, sys, time, functools, importlib.abc, importlib.machinery
def _proc_start():
    with open('/proc/self/stat') as f: st = int(f.read().rsplit(')',1)[1].split()[19])
    with open('/proc/uptime') as f: up = float(f.read().split()[0])
    hz = os.sysconf('SC_CLK_TCK')
    return time.time() - (up - st / hz)
START = _proc_start()
EVENTS = []
def mark(name):
    EVENTS.append((time.time() - START, time.process_time(), name))
mark("startup_timeline.py running")
TARGETS = {
 "expertcache.cli.main": ["build_parser"],
 "expertcache.cli.generate": ["run", "load_prompt", "offload_from_args", "check_context"],
 "expertcache.offload.runtime": ["load_config_checked", "check_weights_match_config", "find_moe_layers", "compile_kernels", "preflight",
    "quantize_dense_skeleton", "load_non_expert", "recompute_rotary", "use_matvec", "say_kernels", "release_free_heap", "_sidecar", "quant_layout_for", "slot_mlps", "family_for", "expert_product"],
 "expertcache.offload.runtime.OffloadedModel": ["__init__", "_plan", "_make_pools", "configure", "generate"],
 "expertcache.cli.gcpause": ["resume_gc"],
 "expertcache.offload.loader": ["load_or_pack_dense", "release_free_heap"],
 "expertcache.models.loader": ["load_tokenizer_checked", "read_config_json", "check_config_values"],
 "expertcache.offload.qlinear": ["fbgemm_prepack"],
 "transformers.models.auto.auto_factory._BaseAutoModelClass": ["from_config"],
 "torch.nn.Module": ["to_empty"],
}
def wrap(owner, name):
    f = getattr(owner, name, None)
    if f is None: print("no", owner, name); return
    if isinstance(owner, type) and isinstance(owner.__dict__.get(name), classmethod):
        raw = owner.__dict__[name].__func__
        @functools.wraps(raw)
        def w(*a, **k):
            mark(f"> {name}"); 
            try: return raw(*a, **k)
            finally: mark(f"< {name}")
        setattr(owner, name, classmethod(w)); return
    @functools.wraps(f)
    def w(*a, **k):
        mark(f"> {name}")
        try: return f(*a, **k)
        finally: mark(f"< {name}")
    setattr(owner, name, w)
def patch(modname):
    for key, names in TARGETS.items():
        mod, _, cls = key.partition(".OffloadedModel") if ".OffloadedModel" in key else (key, "", "")
        if key == "expertcache.offload.runtime.OffloadedModel" and modname == "expertcache.offload.runtime":
            owner = sys.modules[modname].OffloadedModel
        elif key.startswith("transformers.models.auto.auto_factory") and modname == "transformers.models.auto.auto_factory":
            owner = sys.modules[modname]._BaseAutoModelClass
        elif key == "torch.nn.Module" and modname == "torch.nn.modules.module":
            owner = sys.modules[modname].Module
        elif key == modname:
            owner = sys.modules[modname]
        else:
            continue
        for n in names: wrap(owner, n)
WATCH = {"expertcache.offload.loader", "expertcache.models.loader", "expertcache.offload.qlinear", "expertcache.cli.main", "expertcache.cli.generate", "expertcache.offload.runtime", "expertcache.cli.gcpause",
         "transformers.models.auto.auto_factory", "torch.nn.modules.module"}
MILESTONES = {"torch", "transformers", "numba", "expertcache.offload", "expertcache.cli.common", "expertcache.cli.generate", "tokenizers", "transformers.models.olmoe.modeling_olmoe", "scipy", "llvmlite"}
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCH and fullname not in MILESTONES: return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None: return spec
        orig = spec.loader.exec_module
        def exec_module(module, orig=orig):
            mark(f"import> {fullname}")
            orig(module)
            mark(f"import< {fullname}")
            if fullname in WATCH: patch(fullname)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Finder())
import atexit
@atexit.register
def dump():
    mark("exit")
    with open(os.environ.get("TIMELINE_OUT", "/dev/stderr"), "w") as f:
        for t, c, n in EVENTS: print(f"{t:7.3f} {c:7.3f} {n}", file=f)
sys.argv = ["expertcache"] + sys.argv[1:]
from expertcache.cli.main import main
rc = main()
sys.exit(rc)
