"""What the LLM and the DiT compute in on a CPU: fp32, bf16 weights, or int8 weights (``COSYVOICE_PRECISION``).

- ``fp32``: every module as loaded; bit-equal to the golden fixtures.
- ``bf16``: weights stored in bfloat16 (converted once at load, not autocast per call): the whole LLM (it then
  runs in bf16; its sampler takes float32 log-probs) and the DiT's per-frame projections with the attention
  between them (:func:`bf16_dit`: a stream caches bf16 keys/values; the residual stream, norms and solver stay
  float32; a DiT wholly in bf16 moved the golden mel by 3% RMS, beyond the bound). Fast only where the CPU
  computes bf16 natively (AVX512-BF16 or AMX, :func:`cpu_features`); elsewhere each op converts.
- ``int8``: torch's dynamic int8 linears (weights int8, activations quantised per call; fbgemm kernels, VNNI
  where the CPU has it): every LLM linear but the unused text head (:func:`cosyvoice.backends.quant.quantize_llm`)
  and the DiT blocks' attention and feed-forward projections, per output channel (:func:`quantize_dit`).
- ``auto``: per stage, the fastest candidate that holds the quality bounds (:data:`BOUNDS`) on THIS model's
  weights and runs faster than fp32 on THIS CPU, both measured at load against fp32 on a fixed synthetic
  input (:func:`check_llm`, :func:`check_flow`; a minute at the released sizes). The candidates come from the
  CPU's flags: int8 everywhere, bf16 only where it is native; for the DiT also its onnxruntime graphs
  (:data:`ORT_FLOW`, when the model folder is known): fp32 (within ~1e-6 of torch: the exact fast path) and int8
  (8-bit weights, u8 or s8 as the CPU needs, :func:`cosyvoice.backends.quant.int8_weights`); for the LLM also
  its Qwen2 stack as one onnxruntime graph per step (:data:`ORT_LLM`, :mod:`cosyvoice.backends.llm_step`), fp32 and
  int8, which drops torch's per-op cost around each weight read. The LLM's check decodes step by step on a KV
  cache, as the engine does, so its seconds are the per-token cost. A stage whose
  candidates all miss a bound, or are slower (int8 on tiny matrices), stays fp32. The measurements are kept per
  CPU and model (:mod:`cosyvoice.backends.auto_store`), so a restart applies them without measuring. On CUDA
  ``auto`` is fp32 (the ``dtype`` argument chooses half precision there).

The vocoder stays float32 on every path (half precision audibly moves its phases; bundle.load_hift).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from cosyvoice.backends.auto_store import AutoStore, machine_key
from cosyvoice.backends.cpu import cpu_features, native_bf16
from cosyvoice.backends.ort import cpu_stage_threads
from cosyvoice.errors import ConfigError
from cosyvoice.system.cpu_load import OtherWork
from cosyvoice.system.malloc import trim
from cosyvoice.weights import give_back

logger = logging.getLogger(__name__)

CHOICES = ("auto", "fp32", "bf16", "int8")
#: what a fast path must hold against fp32 (issue 21): the DiT's mel (relative RMS, max |diff|), the LLM's mean
#: KL per teacher-forced step (nats)
BOUNDS = {"mel_rel_rms": 0.01, "mel_max_abs": 0.05, "llm_kl_mean": 0.02}
#: the DiT's onnxruntime paths (backend names): fp32 graphs, and int8 ones
ORT_FLOW = ("onnxruntime", "onnxruntime-int8")
#: the LLM's onnxruntime paths: its stack as one graph per step (:mod:`cosyvoice.backends.llm_step`) -> precision
ORT_LLM = {"onnxruntime": "fp32", "onnxruntime-int8": "int8"}
#: auto's checks timed beside other work taking more than this share of the cores (another program, a neighbour on
#: the host): its choice runs, but is measured again at the next start rather than kept for good, since a neighbour
#: that starts or stops between two candidates ranks them by itself (:class:`~cosyvoice.system.cpu_load.OtherWork`)
BUSY_SHARE = 0.25
#: what the torch candidates compute, in auto's kept key (:func:`~cosyvoice.backends.auto_store.graph_formats`):
#: 3, the bf16 DiT's projections packed by oneDNN with the GELU on the accumulator where bf16 is native (2: the
#: attention and cached keys/values in bf16; 1: in float32)
TORCH_FORMAT = 3
T = TypeVar("T")


def candidates(features: frozenset[str]) -> tuple[str, ...]:
    """The torch fast paths ``auto`` tries on a CPU with ``features``, fastest first (fp32 is the fallback)."""
    return ("int8", "bf16") if native_bf16(features) else ("int8",)


def _ort_ready(model_root: Path | None) -> bool:
    """Whether onnxruntime candidates can run: the package is installed and the model folder (where their graphs
    are exported on first use) is known."""
    return model_root is not None and importlib.util.find_spec("onnxruntime") is not None


def flow_candidates(features: frozenset[str], model_root: Path | None) -> tuple[str, ...]:
    """The DiT's candidates: the torch ones, then its onnxruntime graphs (:func:`_ort_ready`)."""
    return candidates(features) + (ORT_FLOW if _ort_ready(model_root) else ())


def llm_candidates(features: frozenset[str], model_root: Path | None) -> tuple[str, ...]:
    """The LLM's candidates: the torch ones, then its one-graph steps (:data:`ORT_LLM`, :func:`_ort_ready`)."""
    return candidates(features) + (tuple(ORT_LLM) if _ort_ready(model_root) else ())


@dataclass(frozen=True)
class PrecisionPlan:
    """What runs: each stage's precision, what was asked for, and why (auto's measurements)."""

    requested: str
    llm: str = "fp32"
    flow: str = "fp32"
    vocoder: str = "fp32"
    cpu: tuple[str, ...] = ()
    checks: dict[str, dict[str, float]] = field(default_factory=dict)  # auto: candidate -> measured bounds
    measured_at: str = ""  # auto: when the checks were measured (ISO time)
    kept: bool = False  # auto: the checks were read from the store, not measured at this start
    others: float | None = None  # auto: the share of the cores other work took while it measured (None: unknown)

    @property
    def busy(self) -> bool:
        """Whether auto measured beside other work (:data:`BUSY_SHARE`): the next start measures again."""
        return self.others is not None and self.others > BUSY_SHARE

    @property
    def label(self) -> str:
        """One line for people: ``int8 (LLM int8, flow int8, vocoder fp32; auto)``."""
        stages = f"LLM {self.llm}, flow {self.flow}, vocoder {self.vocoder}"
        same = {self.llm, self.flow}
        head = same.pop() if len(same) == 1 else "mixed"
        return f"{head} ({stages}; {self.requested})"

    def runs(self, name: str) -> bool:
        """Whether asking for precision ``name`` gets what this plan runs: the name both stages run, or ``auto``
        when auto made the plan. A batch row naming anything else needs a model loaded at it."""
        return self.llm == self.flow == name or name == self.requested == "auto"

    @property
    def summary(self) -> str:
        """auto's measurements in one line (empty for an explicit precision): each candidate's seconds on the
        check and its error against fp32, the chosen marked, and whether they were measured at this start."""
        if not self.checks:
            return ""
        parts = []
        for stage, chosen in (("llm", self.llm), ("flow", self.flow)):
            rows = []
            for name, check in self.checks.items():
                if name.startswith(f"{stage}_"):
                    kind = name[len(stage) + 1:]
                    errors = ", ".join(f"{k} {v:.3g}" for k, v in check.items() if k != "seconds")
                    mark = "*" if kind == chosen else ""
                    rows.append(f"{mark}{kind} {check['seconds']:.2f} s" + (f" ({errors})" if errors else ""))
            parts.append(f"{stage.upper() if stage == 'llm' else stage}: " + "; ".join(rows))
        when = f"kept from {self.measured_at}" if self.kept else f"measured {self.measured_at}"
        if self.busy:
            when += f" beside other work on {self.others:.0%} of the cores: measured again at the next start"
        return " | ".join(parts) + f" | {when}"

    def describe(self) -> dict[str, object]:
        return {"requested": self.requested, "llm": self.llm, "flow": self.flow, "vocoder": self.vocoder,
                "cpu": list(self.cpu), "checks": self.checks, "label": self.label, "measured_at": self.measured_at,
                "kept": self.kept, "others": self.others, "summary": self.summary}


def check_name(name: str) -> str:
    if name not in CHOICES:
        raise ConfigError(f"precision must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


class Bf16Linear(torch.nn.Module):
    """A linear layer whose weights are stored in bfloat16: its input is rounded to bf16 and its output stays bf16,
    which the next bf16 projection or the attention reads as it is and the residual stream promotes back to float32
    (``x + gate * out``), so no pass over the activations only converts them. ``gelu``: the tanh GELU after it (the
    feed-forward's first layer with its activation, whose output only the second layer reads)."""

    def __init__(self, linear: torch.nn.Linear, gelu: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features, self.gelu = linear.in_features, linear.out_features, gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight, self.bias)
        return torch.nn.functional.gelu(y, approximate="tanh") if self.gelu else y


class PackedBf16Linear(Bf16Linear):
    """:class:`Bf16Linear` with its weight in oneDNN's blocked layout, packed once at load instead of at every
    call, and the GELU run on the float32 accumulator as the GEMM's epilogue (one pass fewer over the widest
    activations, and one rounding fewer): 5-25 % less per layer at the DiT's shapes (docs/perf.md). Where the CPU
    computes bf16 natively (:func:`~cosyvoice.backends.cpu.native_bf16`) and torch has oneDNN."""

    def __init__(self, linear: torch.nn.Linear, gelu: bool = False) -> None:
        super().__init__(linear, gelu)
        # a buffer, not a parameter: the packed tensor is opaque (no storage), and what holds the numbers is its dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        del self.weight
        self.register_buffer("weight", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.weight, self.bias,
                                                  "gelu" if self.gelu else "none", [], "tanh" if self.gelu else "")


def packs_bf16() -> bool:
    """Whether :func:`bf16_dit` packs its projections here (:class:`PackedBf16Linear`): bf16 native, oneDNN in torch."""
    return native_bf16(cpu_features()) and torch.backends.mkldnn.is_available()


def dit_projections(dit: torch.nn.Module) -> list[str]:
    """The DiT linears a fast path changes: every block's attention q/k/v/out and feed-forward layers, which
    hold nearly all of its FLOPs (the layers of the ONNX int8 graph, :mod:`cosyvoice.backends.quant`). The AdaLN
    and time linears (two rows per call, their scales steer every frame) and the input/output projections stay
    float32."""
    return [n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear)
            and n.startswith("transformer_blocks.") and (".attn.to_" in n or ".ff." in n)]


def quantize_dit(dit: torch.nn.Module) -> torch.nn.Module:
    """The DiT with :func:`dit_projections` int8 (weights per output channel, activations per call)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    from cosyvoice.backends.quant import quantize_linears

    return quantize_linears(dit, dit_projections(dit), per_channel_dynamic_qconfig)


def bf16_dit(dit: torch.nn.Module) -> torch.nn.Module:
    """The DiT with :func:`dit_projections` holding bf16 weights (:class:`Bf16Linear`, packed where the CPU computes
    bf16 natively: :class:`PackedBf16Linear`; the feed-forward's first layer takes its GELU with it) and its
    attention in bf16 between them (``Attention.compute_dtype``: the keys/values a stream caches are half the
    bytes); each float32 linear's checkpoint pages are handed back once its copy is made
    (:func:`~cosyvoice.weights.give_back`)."""
    layer = PackedBf16Linear if packs_bf16() else Bf16Linear
    for name in dit_projections(dit):
        parent, _, child = name.rpartition(".")
        owner = dit.get_submodule(parent)
        linear = getattr(owner, child)
        if isinstance(owner, torch.nn.Sequential) and isinstance(owner[-1], torch.nn.GELU):
            assert owner[-1].approximate == "tanh" and len(owner) == 2, owner
            grand, _, slot = parent.rpartition(".")
            setattr(dit.get_submodule(grand), slot, layer(linear, gelu=True))
        else:
            setattr(owner, child, layer(linear))
        give_back(linear.parameters())
    for block in dit.transformer_blocks:
        block.attn.compute_dtype = torch.bfloat16
    return dit


def apply_llm(llm: torch.nn.Module, kind: str, model_root: Path | None = None) -> torch.nn.Module:
    """``llm`` in ``kind``; an onnxruntime kind (:data:`ORT_LLM`) runs its Qwen2 stack in the step graph of
    ``model_root`` and frees the stack's torch weights."""
    from cosyvoice.backends.quant import quantize_llm

    if kind in ORT_LLM:
        from cosyvoice.backends.llm_step import attach_step, release_stack

        assert model_root is not None, "the onnxruntime paths need the model folder"
        release_stack(attach_step(llm, model_root, ORT_LLM[kind]))
        return llm
    if kind == "bf16":
        return llm.to(torch.bfloat16)
    return quantize_llm(llm) if kind == "int8" else llm


def apply_flow(flow: torch.nn.Module, kind: str, model_root: Path | None = None) -> torch.nn.Module:
    """``flow`` with its DiT's projections in ``kind``; the rest of the flow stays float32. An onnxruntime kind
    (:data:`ORT_FLOW`) runs the DiT in the graphs of ``model_root`` instead."""
    dit = flow.decoder.estimator
    if kind in ORT_FLOW:
        from cosyvoice.backends import attach_flow

        assert model_root is not None, "the onnxruntime paths need the model folder"
        return attach_flow(flow, model_root, kind, "cpu")
    if kind == "bf16":
        bf16_dit(dit)
    elif kind == "int8":
        quantize_dit(dit)
    return flow


def resolve(requested: str, device: torch.device, backend: str) -> str:
    """``requested`` checked against the device and the DiT backend: the name to plan with."""
    check_name(requested)
    if device.type != "cpu":
        if requested in ("bf16", "int8"):
            raise ConfigError(f"precision {requested!r} is for the CPU; on {device} choose dtype (fp32, bf16, "
                              "fp16) instead")
        return "fp32"
    if backend != "torch" and requested != "fp32":
        raise ConfigError(f"precision {requested!r} applies to the torch modules; backend {backend!r} runs the DiT "
                          "in its own graphs: choose one of them (COSYVOICE_BACKEND=torch or "
                          "COSYVOICE_PRECISION=fp32)")
    return requested


def plan_and_apply(requested: str, load_llm: Callable[[], torch.nn.Module], load_flow: Callable[[], torch.nn.Module],
                   features: frozenset[str] | None = None, model_root: Path | None = None,
                   store: AutoStore | None = None, model_digest: Callable[[], str] | None = None
                   ) -> tuple[PrecisionPlan, torch.nn.Module, torch.nn.Module]:
    """(the plan, the LLM, the flow) for ``requested`` (a resolved name), from loaders of the fp32 modules on the CPU.

    Each stage is loaded and given its precision before the next is loaded: the fp32 weights int8 replaces, and
    the candidates ``auto`` rejects, are gone before the flow is read, so a load's peak memory holds one stage's
    fp32 weights beside the other's final ones, not both stages in fp32 (3.3 GB at the released sizes). The
    freed weights are handed back to the system after each stage (:func:`trim`: glibc keeps them otherwise).

    ``model_root``: the model folder (the DiT's onnxruntime candidates are exported there). ``store`` with
    ``model_digest``: where auto keeps its measurements per CPU and model; a kept one is applied unmeasured."""
    features = cpu_features() if features is None else features
    cpu = tuple(sorted(features))
    if requested == "auto":
        key = machine_key(features, model_digest()) if store is not None and model_digest is not None else None
        kept = store.get(key) if key is not None else None
        if kept is not None:
            plan = PrecisionPlan("auto", str(kept["llm"]), str(kept["flow"]), cpu=cpu, checks=kept["checks"],
                                 measured_at=str(kept["measured_at"]), kept=True, others=kept.get("others"))
            if not plan.busy:
                llm = apply_llm(load_llm(), plan.llm, model_root)
                trim()
                flow = apply_flow(load_flow(), plan.flow, model_root)
                trim()
                logger.info("precision: %s (auto's measurements kept from %s)", plan.label, plan.measured_at)
                return plan, llm, flow
            logger.info("precision: auto's kept measurements (%s) ran beside other work on %.0f%% of the cores: "
                        "measuring again", plan.measured_at, 100 * plan.others)
        others = OtherWork()
        llm_kind, llm, llm_checks = check_llm(load_llm(), llm_candidates(features, model_root), model_root)
        trim()
        flow_kind, flow, flow_checks = check_flow(load_flow(), flow_candidates(features, model_root), model_root)
        trim()
        checks, share = {**llm_checks, **flow_checks}, others.share()
        when = store.put(key, llm_kind, flow_kind, checks, share) if key is not None else ""
        plan = PrecisionPlan("auto", llm_kind, flow_kind, cpu=cpu, checks=checks, measured_at=when, others=share)
        logger.info("precision: %s", plan.label)
        if plan.busy:
            logger.warning("precision: auto measured beside other work on %.0f%% of the cores; its choice may not be "
                           "this machine's best: the next start measures again", 100 * share)
        return plan, llm, flow
    if requested == "bf16" and not native_bf16(features):
        logger.warning("precision bf16 on a CPU without AVX512-BF16 or AMX: every op converts, expect it to "
                       "run slower than fp32 (auto would not pick it here)")
    plan = PrecisionPlan(requested, requested, requested, cpu=cpu)
    logger.info("precision: %s", plan.label)
    llm = apply_llm(load_llm(), plan.llm)
    trim()
    flow = apply_flow(load_flow(), plan.flow)
    trim()
    return plan, llm, flow


# ---------------------------------------------------------------------------------------------- measuring


def _timed(fn: Callable[[], T], stage: int) -> tuple[T, float]:
    """``fn()`` and its seconds, run on the intra-op threads the engine gives ``stage`` (0: the LLM, 1: the flow,
    every core: its team whenever the LLM has no step to run), as onnxruntime's candidates' sessions are
    (:func:`~cosyvoice.backends.ort.cpu_stage_threads`). Timed on other threads than the engine's, torch's kernels
    won a quiet machine's check (torch bf16 DiT) and lost a loaded one's (onnxruntime int8) (docs/perf.md,
    2026-12-06, 08:03)."""
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_stage_threads(stage))
    try:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def teacher_forced_log_probs(llm: torch.nn.Module, seq: torch.Tensor, start: int) -> torch.Tensor:
    """Float32 log-probs [T - start, V] of every position from ``start`` of the embedded sequence ``seq`` [1, T, H],
    computed as the engine decodes: a prefill to ``start``, then one position per step on a KV cache, so timing
    this times the per-token steps where the LLM spends its time."""
    seq = seq.to(llm.speech_embedding.weight.dtype)
    cache = llm.llm.new_cache(1, seq.shape[1])
    rows = [llm.decode_step(seq[:, :start + 1], 0, cache)[1]]
    rows += [llm.decode_step(seq[:, i:i + 1], i, cache)[1] for i in range(start + 1, seq.shape[1])]
    return torch.cat(rows).float()


def kl_mean(ref_lp: torch.Tensor, got_lp: torch.Tensor) -> float:
    """Mean over steps of KL(ref || got) in nats (entries masked to -inf on either side are left out)."""
    finite = torch.isfinite(ref_lp) & torch.isfinite(got_lp)
    return float(torch.where(finite, ref_lp.exp() * (ref_lp - got_lp), 0).sum(-1).mean())


def forced_sequence(ref: torch.nn.Module, lm_input: torch.Tensor, forced: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``lm_input`` [1, T, H] then the embeddings of ``forced`` but its last, the first scored position)."""
    with torch.inference_mode():
        return torch.cat([lm_input, ref.speech_embedding(forced[:-1])[None]], dim=1), lm_input.shape[1] - 1


def llm_kl(ref: torch.nn.Module, got: torch.nn.Module, lm_input: torch.Tensor, forced: torch.Tensor) -> float:
    """Mean KL(ref || got) per step, in nats, teacher-forcing ``forced`` speech tokens after ``lm_input``
    (the reference LLM's embeddings [1, T, H], so both see the same input)."""
    seq, start = forced_sequence(ref, lm_input, forced)
    return kl_mean(teacher_forced_log_probs(ref, seq, start), teacher_forced_log_probs(got, seq, start))


def mel_error(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    diff = ref.float() - got.float()
    return {"mel_max_abs": float(diff.abs().max()),
            "mel_rel_rms": float(diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt())}


def holds(measured: dict[str, float]) -> bool:
    return all(measured[k] <= bound for k, bound in BOUNDS.items() if k in measured)


def _synthetic_llm_input(llm: torch.nn.Module, n_text: int = 24, n_prompt: int = 24,
                         n_forced: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed zero-shot-shaped LLM input (text ids + prompt speech tokens) and forced tokens: seeded, so the
    check is the same on every load of the same weights."""
    gen = torch.Generator().manual_seed(0)
    speech = llm.speech_token_size
    text = torch.randint(0, min(1000, llm.llm.embed_tokens.num_embeddings), (n_text,), generator=gen)
    prompt_speech = torch.randint(0, speech, (n_prompt,), generator=gen)
    forced = torch.randint(0, speech, (n_forced,), generator=gen)
    with torch.inference_mode():
        lm_input = llm.build_lm_input(text, torch.zeros(0, dtype=torch.long), prompt_speech)
    return lm_input, forced


def _flow_mels(flow: torch.nn.Module, n_prompt: int = 13, n_tokens: int = 25) -> tuple[list[torch.Tensor], float]:
    """(the mel of a fixed synthetic input whole and chunk-masked, the faster call's seconds): the prompt plus
    one chunk and a bit."""
    gen = torch.Generator().manual_seed(0)
    vocab = flow.input_embedding.num_embeddings
    tok = torch.randint(0, vocab, (1, n_tokens), generator=gen)
    ptok = torch.randint(0, vocab, (1, n_prompt), generator=gen)
    pfeat = torch.randn(1, n_prompt * flow.token_mel_ratio, flow.spk_embed_affine_layer.out_features, generator=gen)
    emb = torch.randn(1, flow.spk_embed_affine_layer.in_features, generator=gen)
    with torch.inference_mode():
        runs = [_timed(lambda s=streaming: flow.inference(tok, n_tokens, ptok, n_prompt, pfeat, pfeat.shape[1], emb,
                                                          s, True), 1) for streaming in (False, True)]
    return [mel for mel, _ in runs], min(s for _, s in runs)


def shadow(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A copy of ``module`` that shares its parameters (``dtype``: holds its own copies in that dtype instead):
    int8 and the DiT's bf16 projections build new weights from the shared ones and never write them, so
    trying a path at load costs only that path's own weights (the released LLM's fp32 weights are 2 GB)."""
    memo: dict[int, object] = {id(p): p if dtype is None else torch.nn.Parameter(p.detach().to(dtype),
                                                                                  requires_grad=False)
                               for p in module.parameters()}
    return copy.deepcopy(module, memo)


def fastest(stage: str, paths: tuple[str, ...], checks: dict[str, dict[str, float]]) -> str:
    """The fastest of ``paths`` for ``stage`` that stays within :data:`BOUNDS` and ran faster than fp32, else fp32."""
    return min((k for k in paths if holds(checks[f"{stage}_{k}"])
                and checks[f"{stage}_{k}"]["seconds"] < checks[f"{stage}_fp32"]["seconds"]),
               key=lambda k: checks[f"{stage}_{k}"]["seconds"], default="fp32")


def check_llm(llm: torch.nn.Module, paths: tuple[str, ...], model_root: Path | None = None
              ) -> tuple[str, torch.nn.Module, dict[str, dict[str, float]]]:
    """(the LLM's path, the LLM, every candidate's measurements against fp32 on its weights): :func:`fastest` of
    ``paths`` (timed on the same check, the better of two runs), else fp32 (the module given). An onnxruntime
    candidate (:data:`ORT_LLM`) is a shadow running the step graph; the stack's torch weights are freed only
    when it wins. The step graph's candidates are left out where it cannot run the stack (:func:`~cosyvoice.
    backends.llm_step.supported`)."""
    from cosyvoice.backends.llm_step import attach_step, release_stack, supported

    paths = tuple(k for k in paths if k not in ORT_LLM or supported(llm.llm.cfg))
    started = time.perf_counter()
    lm_input, forced = _synthetic_llm_input(llm)
    seq, start = forced_sequence(llm, lm_input, forced)

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, float]:
        runs = [_timed(lambda: teacher_forced_log_probs(model, seq, start), 0) for _ in range(2)]
        return runs[-1][0], min(s for _, s in runs)

    ref_lp, seconds = run(llm)
    checks = {"llm_fp32": {"seconds": seconds}}
    tried = {"fp32": llm}
    for kind in paths:
        if kind in ORT_LLM:
            got = tried[kind] = attach_step(shadow(llm), model_root, ORT_LLM[kind])
        else:
            got = tried[kind] = apply_llm(shadow(llm, torch.bfloat16 if kind == "bf16" else None), kind)
        lp, seconds = run(got)
        checks[f"llm_{kind}"] = {"llm_kl_mean": kl_mean(ref_lp, lp), "seconds": seconds}
    chosen = fastest("llm", paths, checks)
    logger.info("precision self-check of the LLM (%.1f s): %s", time.perf_counter() - started, checks)
    if chosen in ORT_LLM:
        release_stack(tried[chosen])
    return chosen, tried[chosen], checks


def check_flow(flow: torch.nn.Module, paths: tuple[str, ...], model_root: Path | None = None
               ) -> tuple[str, torch.nn.Module, dict[str, dict[str, float]]]:
    """(the DiT's path, the flow, every candidate's measurements against fp32 on its weights): :func:`fastest` of
    ``paths`` (timed on the same check, the better of two runs), else fp32 (the module given). An onnxruntime
    candidate (:data:`ORT_FLOW`) is a shadow with the graphs' runner; the blocks' torch weights are freed only
    when it wins."""
    from cosyvoice.backends import flow_runner, release_blocks

    started = time.perf_counter()
    ref_mels, seconds = _flow_mels(flow)
    checks = {"flow_fp32": {"seconds": min(seconds, _flow_mels(flow)[1])}}
    tried = {"fp32": flow}
    for kind in paths:
        if kind in ORT_FLOW:
            got = tried[kind] = shadow(flow)
            got.decoder.estimator.runner = flow_runner(got, model_root, kind, "cpu")
        else:
            got = tried[kind] = apply_flow(shadow(flow), kind)
        _flow_mels(got)  # a warm-up: quantised and bf16 kernels pack their weights on first use
        mels, seconds = _flow_mels(got)
        errors = [mel_error(r, g) for r, g in zip(ref_mels, mels, strict=True)]
        checks[f"flow_{kind}"] = {**{k: max(e[k] for e in errors) for k in errors[0]}, "seconds": seconds}
    chosen = fastest("flow", paths, checks)
    logger.info("precision self-check of the flow (%.1f s): %s", time.perf_counter() - started, checks)
    if chosen in ORT_FLOW:
        release_blocks(tried[chosen])
    return chosen, tried[chosen], checks


__all__ = ["BOUNDS", "BUSY_SHARE", "CHOICES", "ORT_FLOW", "ORT_LLM", "AutoStore", "Bf16Linear", "PackedBf16Linear",
           "PrecisionPlan", "apply_flow", "apply_llm", "bf16_dit", "candidates", "check_flow", "check_llm",
           "cpu_features", "dit_projections", "fastest", "flow_candidates", "holds", "llm_candidates", "llm_kl",
           "mel_error", "native_bf16", "packs_bf16", "plan_and_apply", "quantize_dit", "resolve", "shadow"]
