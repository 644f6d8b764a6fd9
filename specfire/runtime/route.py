"""The route selector: which decoding route serves a request, and why."""
from __future__ import annotations

from ..config import SamplingParams, SpecPolicy
from ..errors import SpecfireError


def select_route(policy: SpecPolicy, mtp_loaded: bool, sp: SamplingParams,
                 topology: str = "single") -> tuple[str, str]:
    """Return (route, reason) with route in {"ar", "mtp", "ngram"}.

    Every topology serves both drafters (the mesh runs them on rank 0), so the route depends on the
    policy, whether the MTP head is loaded and the request; `topology` only labels the reason.
    `auto` falls back to AR with a reason; an explicit `mtp` that cannot be served raises
    SpecfireError (never a silent fallback)."""
    if policy.mode == "off":
        return "ar", "speculation off by policy"
    if policy.mode == "mtp":
        if not mtp_loaded:
            raise SpecfireError("spec mode 'mtp' requested but no MTP head is loaded (the checkpoint has no "
                                "mtp.* tensors or the model was loaded with spec mode 'off')")
        return "mtp", f"MTP head requested (k={policy.k}, {topology})"
    if policy.mode == "ngram":
        return "ngram", f"n-gram prompt lookup requested (k={policy.k}, {topology})"
    # auto
    if sp.max_tokens == 1:
        return "ar", "auto: a single token leaves nothing to speculate"
    if mtp_loaded:
        return "mtp", f"auto: MTP head loaded (k={policy.k}, {topology})"
    return "ar", "auto: no MTP head loaded"
