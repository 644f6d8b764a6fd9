"""Drafters: the protocol the step uses (base.py), one module per drafter (mtp.py, ngram.py), the
MTP draft chain they share with the CUDA graphs (chain.py), and the registry of routes
(registry.py)."""
from .base import NO_DRAFT, Drafter, HostDrafter
from .chain import argmax, draft_chain, penalized_argmax
from .mtp import MtpDrafter
from .ngram import NgramDrafter
from .registry import BY_NAME, KINDS, DrafterKind, DraftSource, drafting_routes, make_drafters

__all__ = ["NO_DRAFT", "Drafter", "HostDrafter", "argmax", "draft_chain", "penalized_argmax", "MtpDrafter",
           "NgramDrafter", "BY_NAME", "KINDS", "DrafterKind", "DraftSource", "drafting_routes", "make_drafters"]
