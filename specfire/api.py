"""The public Python API: LLM, SamplingParams, SpecPolicy, GenerationResult."""
from __future__ import annotations

import os
import sys
from typing import Any, Iterator, Sequence

import torch

from .config import GenerationDefaults, ModelConfig, check_generation_config
from .errors import CheckpointError, SpecfireError
from .kernels.attention import Q8_KV
from .params import DTYPE_NAMES, SamplingParams, SpecPolicy, check_draft_vocab, check_max_num_seqs, parse_bytes
from .report import RequestFigures
from .runtime.build import EngineOptions, TrunkFactory, build_engine, local_trunk
from .runtime.engine import GenerationResult, StreamChunk
from .runtime.prefix import PrefixCache
from .runtime.prompts import Prompts
from .runtime.route import RoutePlan
from .runtime.scheduler import Request, Scheduler, follow, run_all
from .runtime.slots import SlotPool, default_max_num_seqs, state_bytes
from .runtime.spec import OnCycle
from .runtime.trunk import LocalTrunk
from .threads import default_threads
from .tokenizer import ChatIds, Tokenizer

BUNDLED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled")
KV_DTYPES = ("auto", "bf16", "fp32", "q8")

__all__ = ["LLM", "SamplingParams", "SpecPolicy", "GenerationResult", "StreamChunk"]


def resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    name = DTYPE_NAMES[dtype]
    return resolve_dtype(None, device) if name is None else getattr(torch, name)


def resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a valid torch device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def trunk_factory(tp: int) -> TrunkFactory:
    """The trunk factory for `tp`: one device, or the tensor-parallel mesh (specfire.parallel)."""
    if tp == 1:
        return local_trunk
    try:
        from .parallel.build import mesh_trunk
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(f"{__package__}.parallel"):
            raise
        raise SpecfireError(f"tp={tp} needs the tensor-parallel mesh (specfire.parallel), which this "
                            f"build does not have; use tp=1") from None
    return mesh_trunk


def _is_batch(prompt: Any) -> bool:
    """A list (or tuple) of prompts (texts or token-id lists); anything else in a list is one prompt
    of token ids, checked id by id (so [1, 2.0] is refused for its 2.0, not read as two prompts)."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(p, (str, list, tuple)) for p in prompt)


def _per_prompt(value: Any, n: int, name: str, many: bool) -> list[Any]:
    """`value` for each of n prompts: a list of n values (several prompts only), or one for all."""
    if many and isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts; give one for all or one per prompt")
        return list(value)
    return [value] * n


class LLM(Prompts):
    """A loaded model ready to generate. Use as a context manager or call close(). On a CPU it sets
    the process's intra-op threads to `threads`, else to default_threads()'s choice.

    Requests run concurrently, each in its own slot (runtime/slots.py, runtime/scheduler.py):
    `max_num_seqs` at most (default 8 on a GPU, 4 on a CPU), and as many as the KV pool can promise
    blocks to: `kv_cache_memory_bytes` sizes the pool of 64-position blocks (model/kvpool.py; default
    max_num_seqs whole sequences, on a GPU no more than leaves 10% of the device free), a request is
    promised what its prompt, max_tokens and drafts may reach and takes the blocks as it grows; on a
    tensor-parallel mesh the budget is per rank (each rank's pool holds its shard of the KV heads,
    the ranks' block tables alike; the MTP head on rank 0 keeps max_seq_len of its own per slot).
    More wait in arrival order.

    `tp_invariant=True`: the same bits at every tp degree, one device included (the canonical math,
    docs/TENSOR_PARALLEL.md; on one device it costs some decode speed). A mesh's trunk computes
    them always; there the option also builds rank 0's MTP head in them, so drafts agree too."""

    def __init__(self, model: str | None = None, tp: int = 1, device: Any = None, dtype: Any = None,
                 kv_dtype: str = "auto", max_seq_len: int | None = None, spec: SpecPolicy | dict | str | None = None,
                 mtp_path: str | None = None, progress: bool | None = None, cuda_graphs: bool | None = None,
                 ngram: tuple[int, int] = (1, 4), draft_vocab: int | None = None, generation_config: str = "auto",
                 threads: int | None = None, max_num_seqs: int | None = None,
                 kv_cache_memory_bytes: int | str | None = None, tp_invariant: bool = False):
        self._closed = True                   # until the engine is built
        # "auto": the checkpoint's generation_config.json supplies the default sampling of a
        # request that passes no SamplingParams (get_default_sampling_params); "none": built-in
        self.generation_config = check_generation_config(generation_config)
        if progress is None:  # a loading bar only where someone watches a terminal
            progress = sys.stderr.isatty()
        self.spec = SpecPolicy.coerce(spec)
        if (not isinstance(ngram, (tuple, list)) or len(ngram) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in ngram)
                or not 1 <= ngram[0] <= ngram[1]):
            raise ValueError(f"ngram must be (n_min, n_max) with 1 <= n_min <= n_max, got {ngram!r}")
        self.ngram = (int(ngram[0]), int(ngram[1]))   # n-gram drafter: suffix sizes to look up
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        if not isinstance(tp_invariant, bool):
            raise ValueError(f"tp_invariant must be True or False, got {tp_invariant!r}")
        self.tp_invariant = tp_invariant
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 2):
            raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        self.path = os.path.abspath(model) if model is not None else BUNDLED_MODEL
        if model is None and not os.path.exists(os.path.join(self.path, "config.json")):
            raise CheckpointError(f"the bundled model is missing from {self.path}; pass a checkpoint path")
        if not os.path.isdir(self.path):
            raise CheckpointError(f"model path {self.path} is not a directory")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive integer, got {threads!r}")
        check_max_num_seqs(max_num_seqs)
        kv_budget = parse_bytes(kv_cache_memory_bytes)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu":         # the process's intra-op threads (default_threads)
            n = threads if threads is not None else default_threads()
            if n is not None:
                torch.set_num_threads(n)
        self.cfg = ModelConfig.from_dir(self.path)
        self.generation_defaults = GenerationDefaults.from_dir(self.path, self.generation_config)
        self.tp = tp
        # the MTP drafter scores token ids 0..draft_vocab-1 only (None: the whole vocabulary); the
        # verify scores them all, so output is unchanged (docs/ARCHITECTURE.md, draft vocabulary)
        self.draft_vocab = check_draft_vocab(draft_vocab, self.cfg.vocab_size)
        if max_seq_len is not None and max_seq_len > self.cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{self.cfg.max_position_embeddings}")
        self.max_seq_len = max_seq_len or min(self.cfg.max_position_embeddings,
                                              32768 if self.device.type == "cuda" else 8192)
        kvd = {"auto": self.dtype, "bf16": torch.bfloat16, "fp32": torch.float32, "q8": Q8_KV}[kv_dtype]
        self.kv_dtype = kvd
        self.tokenizer = Tokenizer(self.path) if os.path.exists(os.path.join(self.path, "tokenizer.json")) else None
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_ids)
        self.eos_ids = eos
        opts = EngineOptions(path=self.path, cfg=self.cfg, tp=tp, device=self.device, dtype=self.dtype,
                             kv_dtype=kvd, max_seq_len=self.max_seq_len, spec=self.spec, mtp_path=mtp_path,
                             cuda_graphs=cuda_graphs, ngram=self.ngram, progress=progress,
                             draft_vocab=self.draft_vocab, tp_invariant=tp_invariant,
                             max_num_seqs=max_num_seqs or default_max_num_seqs(self.device),
                             kv_cache_memory_bytes=kv_budget)
        self.engine = build_engine(opts, self.tokenizer, eos, trunk_factory(tp))
        self.cfg = self.engine.trunk.cfg      # the checkpoint decides whether lm_head is tied
        try:
            share, mtp = None, self.engine.mtp_loaded
            pooled = self.engine.trunk.kv_pool is not None     # then the budget sized the pool
            slot = state_bytes(self.cfg, self.max_seq_len, kvd, mtp, None, kv=not pooled)
            if tp > 1:                        # a slot costs each rank its shard (the MTP head's KV: in rank 0's pool)
                from .parallel import ShardPlan
                share = ShardPlan(self.cfg, tp, 0)
                slot = state_bytes(self.cfg, self.max_seq_len, kvd, mtp, share, kv=not pooled)
            self.slots = SlotPool(self.engine, opts.max_num_seqs, slot, kv_budget)
        except BaseException:
            self.engine.trunk.close()
            raise
        self.scheduler = Scheduler(self.slots)
        self._closed = False

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.scheduler.close()            # running and waiting requests end (cancelled)
        finally:
            for eng in self.slots.engines:
                eng.trunk.close()
            self.engine = None  # type: ignore[assignment]

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SpecfireError("this LLM has been closed")

    @property
    def mtp_loaded(self) -> bool:
        return self.engine.mtp_loaded

    # ---- requests ------------------------------------------------------------------------------
    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams of a request that sets only `overrides` (None values count as not
        set): the model's generation_config.json defaults (`generation_defaults`; none with
        generation_config="none") over SamplingParams' built-in ones. generate() and stream()
        use it when no params are given; an explicit SamplingParams(...) is taken as it is."""
        kw = self.generation_defaults.as_dict()
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**kw)

    def _request(self, prompt: str | Sequence[int], params: SamplingParams | None,
                 spec: SpecPolicy | dict | str | None, on_cycle: OnCycle | None,
                 plan: RoutePlan | None) -> Request:
        """A scheduler request of one prompt; its arguments checked as stream() checks them."""
        if plan is not None and not isinstance(plan, RoutePlan):
            raise ValueError(f"plan must be a RoutePlan from plan_route(), got {type(plan).__name__}")
        if params is None and plan is not None:
            params = plan.params
        sp = params if params is not None else self.get_default_sampling_params()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(sp).__name__}")
        policy = plan.policy if spec is None and plan is not None else SpecPolicy.coerce(spec, self.spec)
        return Request(self._ids(prompt), sp, policy, lambda kind, payload: None, plan=plan, on_cycle=on_cycle)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               spec: SpecPolicy | dict | str | None = None, *, on_cycle: OnCycle | None = None,
               plan: RoutePlan | None = None) -> Iterator[StreamChunk]:
        """Yield StreamChunk(text, token_ids); the last chunk carries `result`. `on_cycle(k, n,
        emitted)` is called after every decoding step (k drafted, n accepted; k = 0 for AR), on
        the thread that runs the step. `plan`: the route `plan_route` decided for these params and
        spec (then they may be left out), so it is not decided again. Streams from several threads
        run concurrently (the scheduler's rounds), each yielding its own request's chunks; closing
        the iterator early cancels the request."""
        self._check_open()
        return follow(self.scheduler, self._request(prompt, params, spec, on_cycle, plan))

    def generate(self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 spec: SpecPolicy | dict | str | Sequence[SpecPolicy | dict | str] | None = None, *,
                 on_cycle: OnCycle | None = None) -> GenerationResult | list[GenerationResult]:
        """One prompt (text or token ids) -> its GenerationResult. A list of prompts (texts or
        lists of token ids), as vLLM takes them, -> their results in order, run concurrently;
        `params` and `spec` may then be one for all or a list, one per prompt. Every request's
        output is what it gives alone. Bad input raises before anything runs."""
        self._check_open()
        many = _is_batch(prompt)
        prompts = list(prompt) if many else [prompt]
        n = len(prompts)
        sps = _per_prompt(params, n, "params", many)
        specs = _per_prompt(spec, n, "spec", many)
        reqs = []
        for p, sp, sc in zip(prompts, sps, specs):
            req = self._request(p, sp, sc, on_cycle, None)
            self.engine.check_prompt(req.ids)
            self.engine.check_sampling(req.params)
            req.plan = self.engine.route(req.spec, req.params)     # decided once, refused before any runs
            reqs.append(req)
        results = [chunk.result for chunk in run_all(self.scheduler, reqs)]
        return results if many else results[0]

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             spec: SpecPolicy | dict | str | None = None) -> GenerationResult:
        return self.generate(self.chat_ids(messages), params, spec)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self.tokenizer is None:
            raise SpecfireError(f"{self.path} has no tokenizer; chat needs one")
        return self.tokenizer.render_chat(messages)

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                 template_kwargs: dict[str, Any] | None = None, allow_special: bool = False) -> ChatIds:
        """The chat's prompt ids, a list that also holds its turn ends: generate() and stream() end
        prefill forwards there, so the next turn resumes from this one's prompt on a cold run's bits
        (enable_prefix_cache). Special tokens spelled inside messages stay text unless `allow_special`."""
        if self.tokenizer is None:
            raise SpecfireError(f"{self.path} has no tokenizer; chat needs one")
        return self.tokenizer.chat_ids(messages, tools, True, template_kwargs, allow_special)

    def score(self, ids: Sequence[int]) -> torch.Tensor:
        """float32 logits [T, vocab] for every position of `ids`."""
        self._check_open()
        ids = self._ids(ids)
        self.engine.check_prompt(ids)

        def task(eng) -> torch.Tensor:        # on a free slot, between the running requests' steps
            return eng.trunk.score(torch.tensor(ids, device=eng.trunk.device))
        return run_all(self.scheduler, [Request(ids, None, None, lambda kind, payload: None, task=task)])[0]

    # ==== serving helpers ========================================================================
    # What the servers and the CLI need (specfire/serve, cli.py), so they never reach into the
    # engine or the trunk: the context length, a route preview, prompt validation, one stats
    # projection.

    @property
    def max_num_seqs(self) -> int:
        """How many requests run at once (more wait in arrival order); `slots.why` says why it is
        below what was asked, where it is."""
        self._check_open()
        return self.slots.limit

    @property
    def max_model_len(self) -> int:
        """The context in tokens (prompt + generated) this model was loaded with."""
        self._check_open()
        return self.engine.max_seq

    def plan_route(self, params: SamplingParams, spec: SpecPolicy | dict | str | None = None) -> RoutePlan:
        """The route generate() takes for these params, decided once by the one route selector:
        raises SpecfireError for a mode this model cannot serve (servers refuse before queueing),
        and is passed to stream(plan=) with the request."""
        self._check_open()
        return self.engine.route(SpecPolicy.coerce(spec, self.spec), params)

    def preview_route(self, params: SamplingParams, spec: SpecPolicy | dict | str | None = None) -> tuple[str, str]:
        """(route, reason) of `plan_route`."""
        plan = self.plan_route(params, spec)
        return plan.route, plan.reason

    def enable_prefix_cache(self, max_bytes: int, piece: int | None = None) -> None:
        """Keep snapshots of recent prompts (at most `max_bytes`; 0 turns reuse off) so that a prompt
        starting with one (a chat's next turn) prefills only the rest; greedy output stays that of
        a cold run. `piece`: prompt rows per prefill forward, the granularity of reuse (default
        1024; it sets the cold prefill too). Single device only."""
        self._check_open()
        if max_bytes == 0:
            self.engine.prefix = None
            return
        if self.tp != 1:
            raise SpecfireError(f"the prefix cache serves one device; this model runs with tp={self.tp}")
        if piece is not None and (not isinstance(piece, int) or piece < 1):
            raise ValueError(f"prefill piece must be a positive integer, got {piece!r}")
        trunk = self.engine.trunk
        assert isinstance(trunk, LocalTrunk)
        if piece is not None:
            for eng in self.slots.engines:    # every slot prefills in the pieces snapshots sit between
                assert isinstance(eng.trunk, LocalTrunk)
                eng.trunk.piece = piece
        self.engine.prefix = PrefixCache(trunk, max_bytes)

    def _check_ids(self, ids: list[int]) -> None:
        self.engine.check_prompt(ids)

    @staticmethod
    def figures(result: GenerationResult, params: SamplingParams) -> RequestFigures:
        """The one projection of a result's stats that every front end prints."""
        return RequestFigures.of(result.stats, result.finish_reason, params.max_tokens)
