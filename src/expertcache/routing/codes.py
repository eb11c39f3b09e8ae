"""The key rules of the policy kernel, by code: plain data at the bottom of ``routing``.

The kernel (:func:`expertcache.routing.kernels.token_keys`) has one branch per code; the registry
(:mod:`expertcache.routing.registry`) accepts a policy only with one of these codes and exactly the flags its rule
reads. Both import this table, so neither imports the other for it. A new key rule: its branch in
``kernels.token_keys``, its entry here.
"""

__all__ = ["KERNEL_CODES"]

#: code -> (the ``RoutingConfig`` field that is the rule's strength, the inputs the caller must supply, as
#: ``PolicySpec`` flags). A policy is registered only with one of these codes and exactly these flags
#: (``routing/registry.py: register_policy``), and ``kernels.pack`` refuses any other code, so a code without a
#: branch in ``token_keys`` is never ranked by another rule's branch.
KERNEL_CODES = {
    0: ("lam", ("running_delta",)),  # Cache-Prior (001 Eq. 9-10)
    1: ("m", ()),  # Max-Rank (001 Alg. 1)
    2: ("beta", ("needs_profile",)),  # ERAS biasing (003 III-B-2): the penalty β·(1 - freq)
    3: ("p", ("needs_probs",)),  # cumulative threshold (001 Alg. 2)
    4: ("alpha", ("needs_probs",)),  # ERAS thresholding (003 III-B-1)
    5: ("lam", ("running_delta", "miss_costs")),  # cost-aware Cache-Prior: the penalty is the load cost
}
