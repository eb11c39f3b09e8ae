"""The output rule (expertcache/outputs.py) at its edges, in-process: a folder output that resolves to the root
(a name with a ``..`` in it too) is refused as "give a folder name", not as a user's folder; an input path that
holds ``=`` and exists (not report's ``FILE=LABEL``) is still an input, so an output onto it is refused; a
``FILE=LABEL`` whose file exists is that file.

Surviving mutants of this file's own set: none.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from expertcache.outputs import OutputError, check_args, check_folder_output


@pytest.mark.parametrize("path", ["/", "/tmp/..", "/tmp/../"])
def test_a_folder_output_that_resolves_to_the_root_is_refused_as_such(path):
    with pytest.raises(OutputError, match=r"give a folder name to write"):
        check_folder_output(path, "--out", "mole export")


def test_an_existing_input_whose_name_holds_an_equals_sign_is_an_input(tmp_path):
    inp = tmp_path / "a=b.trace"
    inp.write_bytes(b"trace bytes")
    args = argparse.Namespace(trace=[str(inp)], out=str(inp))
    with pytest.raises(OutputError, match=r"is the input"):
        check_args(args, "report")
    assert inp.read_bytes() == b"trace bytes"


def test_file_equals_label_names_the_file(tmp_path):
    inp = tmp_path / "t.trace"
    inp.write_bytes(b"trace bytes")
    args = argparse.Namespace(trace=[f"{inp}=my label"], out=str(inp))
    with pytest.raises(OutputError, match=r"is the input"):
        check_args(args, "report")
    check_args(argparse.Namespace(trace=[f"{inp}=my label"], out=str(tmp_path / "other.json")), "report")
