"""The floor section of ``benchmark_cpu.py`` (``--floor``; its module docstring, 5.): this machine's own peaks,
one thread, CPU time, and the DiT's, the LLM's and the vocoder's paths against them."""

from __future__ import annotations

import json
import resource
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from cpu_quality import golden_flow_inputs, mel_errors, quality_mels

from cosyvoice.backends import precision as fast
from cosyvoice.bundle import validate_model_dir
from cosyvoice.flow.dit_cache import DiTCache
from cosyvoice.hifigan import HiFTStream


def process_cpu_s() -> float:
    """This process's CPU seconds, user and system (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


#: the DiT's paths the floor section measures (label -> torch, or an onnxruntime graph precision); the torch bf16
#: one (projections and attention, :func:`~cosyvoice.backends.precision.bf16_dit`) where the CPU computes bf16
#: natively, as auto tries it; last, as it converts the module in place
DIT_PATHS = {"torch fp32, AdaLN recomputed (before)": "torch-recompute", "torch fp32 + AdaLN cache": "torch",
             "onnxruntime fp32": "fp32", "onnxruntime int8": "int8", "torch bf16 + AdaLN cache": "torch-bf16"}


def dit_paths_here() -> dict[str, str]:
    """:data:`DIT_PATHS` this CPU runs (bf16 only where it is native)."""
    native = fast.native_bf16(fast.cpu_features())
    return {name: path for name, path in DIT_PATHS.items() if path != "torch-bf16" or native}


def _cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The best process CPU seconds of ``repeats`` calls (one thread: CPU time is its work, whatever the load)."""
    best = float("inf")
    for _ in range(repeats):
        start = process_cpu_s()
        fn()
        best = min(best, process_cpu_s() - start)
    return best


#: the DiT's projection shapes the GEMM peaks are measured at: 2 x 100 frames (a first chunk's CFG pair) by the
#: 1024 x 1024 and 1024 x 2048 projections, and 2 x 450 (a final call) by 1024 x 1024
GEMM_SHAPES = {"200x1024x1024": (200, 1024, 1024), "200x1024x2048": (200, 1024, 2048),
               "900x1024x1024": (900, 1024, 1024)}


def machine_floor() -> dict[str, float]:
    """One thread's fp32 GEMM peak at the DiT's shapes (:data:`GEMM_SHAPES`, the best of them and of two libraries:
    torch's BLAS and onnxruntime's MLAS, which on an AMD CPU outruns MKL, so that the floor is the machine's), its
    bf16 one (torch's, the kernel of the bf16 DiT), its int8 GEMM peak at the same shapes (:func:`int8_gemm_gops`)
    and its GEMV read bandwidth over a 256 MB weight."""
    torch.set_num_threads(1)
    out: dict[str, float] = {}
    for name, shape in GEMM_SHAPES.items():
        out[f"gemm_{name}_gflops"] = torch_gemm_gflops(*shape, torch.float32)
    for name, shape in GEMM_SHAPES.items():
        out[f"ort_gemm_{name}_gflops"] = ort_gemm_gflops(*shape)
    out["gemm_peak_gflops"] = max(v for k, v in out.items() if "gemm_" in k)
    for name, shape in GEMM_SHAPES.items():
        out[f"bf16_gemm_{name}_gflops"] = torch_gemm_gflops(*shape, torch.bfloat16)
    out["bf16_gemm_peak_gflops"] = max(v for k, v in out.items() if k.startswith("bf16_gemm_"))
    for name, shape in GEMM_SHAPES.items():
        out[f"int8_gemm_{name}_gops"] = int8_gemm_gops(*shape)
    out["int8_gemm_peak_gops"] = max(v for k, v in out.items() if k.startswith("int8_gemm_"))
    w, x = torch.randn(8192, 8192), torch.randn(8192)
    seconds = _cpu_seconds(lambda: [torch.mv(w, x) for _ in range(5)], 3) / 5
    out["gemv_gb_per_s"] = w.numel() * 4 / seconds / 1e9
    return out


def torch_gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """One thread's GFLOP/s of torch's matmul in ``dtype`` at [m, k] x [k, n]."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / (_cpu_seconds(lambda: [a @ b for _ in range(10)], 3) / 10) / 1e9


def _ort_matmul_rate(op: str, a: np.ndarray, b: np.ndarray) -> float:
    """One thread's multiply-adds per second, counted as 2 ops each, of onnxruntime's ``op`` (``MatMul`` or
    ``MatMulInteger``) for ``a`` [m, k] by the stored weight ``b`` [k, n] (numpy arrays)."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    from onnx.helper import np_dtype_to_tensor_dtype

    (m, k), n = a.shape, b.shape[1]
    out_type = np_dtype_to_tensor_dtype(a.dtype if op == "MatMul" else np.dtype(np.int32))
    graph = helper.make_graph([helper.make_node(op, ["a", "b"], ["y"])], "gemm",
                              [helper.make_tensor_value_info("a", np_dtype_to_tensor_dtype(a.dtype), [m, k])],
                              [helper.make_tensor_value_info("y", out_type, [m, n])],
                              [numpy_helper.from_array(b, "b")])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    seconds = _cpu_seconds(lambda: [session.run(None, {"a": a}) for _ in range(10)], 3) / 10
    return 2 * m * k * n / seconds / 1e9


def ort_gemm_gflops(m: int, k: int, n: int) -> float:
    """One thread's fp32 GFLOP/s of onnxruntime's ``MatMul`` (MLAS) at [m, k] x [k, n]: the kernel the fp32 graphs'
    projections run."""
    rng = np.random.default_rng(0)
    return _ort_matmul_rate("MatMul", rng.standard_normal((m, k), dtype=np.float32),
                            rng.standard_normal((k, n), dtype=np.float32))


def int8_gemm_gops(m: int, k: int, n: int) -> float:
    """One thread's int8 multiply-adds per second (as 2 ops each) of onnxruntime's ``MatMulInteger`` at [m, k] x
    [k, n]: the kernel the int8 graphs' projections run, u8 activations by the weight type the int8 DiT stores on
    this CPU (:func:`~cosyvoice.backends.quant.int8_weights`: s8 with VNNI, else u8), int32 out."""
    from cosyvoice.backends.cpu import cpu_features
    from cosyvoice.backends.quant import int8_weights

    rng = np.random.default_rng(0)
    signed = int8_weights(cpu_features()) == "s8"
    b = rng.integers(-128 if signed else 0, 128 if signed else 256, (k, n)).astype(np.int8 if signed else np.uint8)
    return _ort_matmul_rate("MatMulInteger", rng.integers(0, 256, (m, k)).astype(np.uint8), b)


def dit_step_work(dit: torch.nn.Module, new: int, past: int, batch: int = 2) -> dict[str, float]:
    """FLOPs of one DiT call over ``new`` frames after ``past`` cached ones (a CFG pair), of them its projections'
    (the int8 graph's int8 work; the attention products and the position convs stay float32), and the bytes of
    AdaLN weights it reads when it recomputes the modulation."""
    block = dit.transformer_blocks[0]
    dim, inner = dit.proj_out.in_features, block.attn.heads * block.attn.dim_head
    ff = block.ff.ff[2].in_features  # the second layer's (the first may carry its GELU: bf16_dit)
    conv = dit.input_embed.conv_pos_embed.conv1[0]
    projections = 2 * new * (3 * dim * inner + inner * dim + 2 * dim * ff)
    per_block = projections + 4 * new * (past + new) * inner
    convs = 2 * 2 * new * dim * (dim // conv.groups) * conv.kernel_size[0]
    depth = len(dit.transformer_blocks)
    flops = batch * (depth * per_block + convs)
    adaln = sum(b.attn_norm.linear.weight.numel() for b in dit.transformer_blocks) * 4
    return {"gflop": flops / 1e9, "int8_gflop": batch * depth * projections / 1e9,
            "bf16_gflop": batch * depth * per_block / 1e9, "adaln_gb": adaln / 1e9}


@torch.inference_mode()
def dit_paths(model_dir: Path, golden: Path | None) -> dict[str, dict[str, float]]:
    """Each of :data:`DIT_PATHS` per Euler step, one thread, at a stream's shapes (see ``benchmark_cpu.py``'s
    module docstring)."""
    from cosyvoice.backends import cache_dtype, ensure_onnx
    from cosyvoice.backends.export import graph_file
    from cosyvoice.backends.ort import OrtGraph
    from cosyvoice.backends.runners import GraphEstimator

    torch.set_num_threads(1)
    manifest = ensure_onnx(model_dir, "int8")  # both graphs exported (once per bundle and CPU) before the flow loads
    flow = validate_model_dir(model_dir).load_flow()
    dit = flow.decoder.estimator
    cfg = flow.cfg.dit
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    t, spks = torch.full((2,), 0.3), randn(2, cfg.spk_dim)
    shapes = {"first chunk from the voice prefix (2 x 100 new over 100)": (100, 100),
              "final call, full attention (2 x 450)": (450, 0)}
    inputs = {}
    for label, (new, past) in shapes.items():
        x, mu, cond = (randn(2, cfg.mel_dim, past + new) for _ in range(3))
        cache = dit.forward_cached(x[..., :past], mu[..., :past], t, spks, cond[..., :past], None, past)[1] \
            if past else None
        inputs[label] = (x[..., past:], mu[..., past:], cond[..., past:], cache, new, past)
    root = model_dir / "onnx"
    golden_inputs = golden_flow_inputs(golden) if golden is not None else None
    reference = quality_mels(flow, golden_inputs) if golden_inputs is not None else None
    results: dict[str, dict[str, float]] = {}
    for name, path in dit_paths_here().items():
        if path == "torch-bf16":
            fast.bf16_dit(dit)
            inputs = {label: (*head, _bf16_cache(cache), new, past)
                      for label, (*head, cache, new, past) in inputs.items()}
        dit.runner = None if path.startswith("torch") else GraphEstimator(
            None, OrtGraph(root / graph_file("flow_estimator_cached", path), torch.device("cpu"), threads=1), dit,
            cache_dtype(manifest, path))
        dit.modulation_cache.max_bytes = 0 if path == "torch-recompute" else 64 << 20
        dit.modulation_cache.clear()
        row: dict[str, float] = {}
        for label, (x, mu, cond, cache, new, _) in inputs.items():
            def call(x=x, mu=mu, cond=cond, cache=cache) -> object:
                return dit.forward_cached(x, mu, t, spks, cond, cache, 0)

            call()  # warm-up: packing, the modulation of this t
            row[f"{label} s"] = _cpu_seconds(call, 2 if new <= 100 else 1)
        if reference is not None:
            row.update(mel_errors(reference, quality_mels(flow, golden_inputs)))
        results[name] = row
        print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)
    results["_work"] = {f"{label} {k}": v for label, (*_, new, past) in inputs.items()
                        for k, v in dit_step_work(dit, new, past).items()}
    return results


def _bf16_cache(cache: DiTCache | None) -> DiTCache | None:
    """``cache`` with its keys/values in bf16, as the bf16 DiT's attention keeps them."""
    if cache is None:
        return None
    return DiTCache(cache.length, cache.conv_tails, [(k.bfloat16(), v.bfloat16()) for k, v in cache.kv])


#: the LLM's paths the floor section measures (label -> precision.apply_llm's kind)
LLM_PATHS = {"torch fp32": "fp32", "torch int8 (dynamic linears)": "int8",
             "onnxruntime fp32, one graph per step": "onnxruntime",
             "onnxruntime int8, one graph per step": "onnxruntime-int8"}
PREFILL, DECODE = 160, 16  # the prefill (3 s prompt + text) and the decode steps timed after it


def llm_work(lm: torch.nn.Module) -> dict[str, float]:
    """The weight bytes a decode step reads (Qwen2 stack + speech head, fp32; int8 stores the stack's linears in
    a quarter) and the FLOPs of a :data:`PREFILL`-position prefill (its linears + causal attention)."""
    stack = lm.llm.model.model
    linears = [m for m in stack.modules() if isinstance(m, torch.nn.Linear)]
    linear_params = sum(m.weight.numel() for m in linears)
    read = sum(p.numel() for n, p in stack.named_parameters() if not n.startswith("embed_tokens."))  # one row read
    other = read - linear_params + lm.llm_decoder.weight.numel()
    attn = stack.layers[0].self_attn
    attention = 2 * len(stack.layers) * PREFILL * PREFILL * attn.n_heads * attn.head_dim  # QK and AV, half masked
    return {"decode_gb_fp32": 4 * (linear_params + other) / 1e9, "decode_gb_int8": (linear_params + 4 * other) / 1e9,
            "prefill_gflop": (2 * PREFILL * (linear_params + lm.llm_decoder.weight.numel()) + attention) / 1e9,
            "prefill_int8_gflop": 2 * PREFILL * linear_params / 1e9}


def _llm_path(ref: torch.nn.Module, kind: str, model_dir: Path) -> torch.nn.Module:
    """``ref``'s shadow on ``kind``; an onnxruntime graph on one intra-op thread (the floor is per thread)."""
    from cosyvoice.backends.llm_step import GraphBackbone, ensure_step
    from cosyvoice.backends.ort import OrtGraph

    if kind not in fast.ORT_LLM:
        return fast.apply_llm(fast.shadow(ref), kind)
    lm = fast.shadow(ref)
    path = ensure_step(ref.llm, model_dir, fast.ORT_LLM[kind])
    lm.llm.runner = GraphBackbone(OrtGraph(path, torch.device("cpu"), threads=1), lm.llm)
    return lm


@torch.inference_mode()
def llm_paths(model_dir: Path) -> dict[str, dict[str, float]]:
    """Each of :data:`LLM_PATHS`, one thread, CPU time: a :data:`PREFILL`-position prefill and the decode steps
    after it (per token, the best of two runs of :data:`DECODE`), and the mean KL per step against fp32 on auto's
    synthetic check (:func:`cosyvoice.backends.precision.check_llm`'s input)."""
    torch.set_num_threads(1)
    ref = validate_model_dir(model_dir).load_llm()
    seq, start = fast.forced_sequence(ref, *fast._synthetic_llm_input(ref))
    ref_lp = fast.teacher_forced_log_probs(ref, seq, start)
    prompt = torch.randn(1, PREFILL, ref.cfg.llm_input_size, generator=torch.Generator().manual_seed(0))
    steps = [prompt[:, i:i + 1] for i in range(DECODE)]
    results: dict[str, dict[str, float]] = {}
    for name, kind in LLM_PATHS.items():
        lm = _llm_path(ref, kind, model_dir)
        cache = lm.llm.new_cache(1, PREFILL + DECODE)
        lm.decode_step(prompt, 0, cache)  # warm-up: packing, the session's first run
        row = {"prefill s": _cpu_seconds(lambda lm=lm, cache=cache: lm.decode_step(prompt, 0, cache), 2)}
        row["decode s per token"] = _cpu_seconds(lambda lm=lm, cache=cache: [
            lm.decode_step(x, PREFILL + i, cache) for i, x in enumerate(steps)], 2) / DECODE
        row["llm_kl_mean"] = 0.0 if kind == "fp32" else fast.kl_mean(ref_lp, fast.teacher_forced_log_probs(lm, seq,
                                                                                                            start))
        results[name] = row
        print(name, json.dumps({k: round(v, 5) for k, v in row.items()}), flush=True)
        del lm, cache
    results["_work"] = llm_work(ref)
    return results


@torch.inference_mode()
def vocoder_path(model_dir: Path, seconds: int = 2) -> dict[str, float]:
    """The vocoder (weight norm folded, as the engine runs it) on ``seconds`` of mel, one thread: CPU seconds and
    FLOPs (torch's counter: its convolutions and matmuls) per audio second."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(1)
    hift = validate_model_dir(model_dir).load_hift()
    hift.fold_weight_norm()
    mel = torch.randn(1, hift.cfg.in_channels, 50 * seconds, generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        wav = HiFTStream(hift).inference(mel, finalize=True)
    audio = wav.shape[-1] / hift.cfg.sampling_rate
    cpu = _cpu_seconds(lambda: HiFTStream(hift).inference(mel, finalize=True), 2)
    return {"s per audio s": cpu / audio, "gflop per audio s": counter.get_total_flops() / 1e9 / audio}


def stage_floor_table(floor: dict[str, float], llm: dict[str, dict[str, float]], vocoder: dict[str, float]) -> str:
    """The LLM's paths and the vocoder against this machine's floor: decode per token = its weight bytes over
    the GEMV bandwidth, prefill and vocoder = their FLOPs over the GEMM peak of their precision (an int8 path's
    stack linears over the int8 peak, the rest over the fp32 one)."""
    work, peak, bandwidth = llm["_work"], floor["gemm_peak_gflops"], floor["gemv_gb_per_s"]
    int8_prefill = work["prefill_int8_gflop"] / floor["int8_gemm_peak_gops"] + \
        (work["prefill_gflop"] - work["prefill_int8_gflop"]) / peak
    rows = ["| stage, path (1 thread) | measured CPU s | floor s | floor / measured | LLM KL vs fp32 (nats) |",
            "| --- | --- | --- | --- | --- |"]
    for name, row in llm.items():
        if name == "_work":
            continue
        weights = "decode_gb_int8" if "int8" in name else "decode_gb_fp32"
        prefill = int8_prefill if "int8" in name else work["prefill_gflop"] / peak
        for label, seconds, floor_s in (("prefill, 160 positions", row["prefill s"], prefill),
                                        ("decode, per token", row["decode s per token"], work[weights] / bandwidth)):
            rows.append(f"| LLM {label}, {name} | {seconds:.4f} | {floor_s:.4f} | {floor_s / seconds:.2f} | "
                        f"{row['llm_kl_mean']:.2e} |")
    voc_floor = vocoder["gflop per audio s"] / peak
    rows.append(f"| vocoder per audio second, torch fp32 | {vocoder['s per audio s']:.3f} | {voc_floor:.3f} | "
                f"{voc_floor / vocoder['s per audio s']:.2f} | |")
    return "\n".join(rows)


def floor_table(floor: dict[str, float], paths: dict[str, dict[str, float]]) -> str:
    """Per path and shape: seconds per step, the step's floor (the int8 graph's projections over the int8 GEMM
    peak, the bf16 DiT's projections and attention products over the bf16 one, the rest of its work over the fp32
    one), the fraction of the floor reached."""
    work = paths["_work"]
    peak, bandwidth, int8_peak = floor["gemm_peak_gflops"], floor["gemv_gb_per_s"], floor["int8_gemm_peak_gops"]
    rows = ["| DiT path (1 thread, per Euler step) | shape | CPU s | floor s | floor / measured | mel rel. RMS "
            "| mel max abs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, row in paths.items():
        if name == "_work":
            continue
        for key, seconds in row.items():
            if not key.endswith(" s"):
                continue
            label = key[:-2]
            reads = work[f"{label} adaln_gb"] / bandwidth if name.endswith("(before)") else 0.0
            int8 = work[f"{label} int8_gflop"] if name.endswith("int8") else 0.0
            bf16 = work[f"{label} bf16_gflop"] if name.startswith("torch bf16") else 0.0
            floor_s = int8 / int8_peak + bf16 / floor["bf16_gemm_peak_gflops"] + \
                (work[f"{label} gflop"] - int8 - bf16) / peak + reads
            rms, mx = row.get("mel_rel_rms"), row.get("mel_max_abs")
            rows.append(f"| {name} | {label} | {seconds:.3f} | {floor_s:.3f} | {floor_s / seconds:.2f} | "
                        f"{'' if rms is None else f'{rms:.2e}'} | {'' if mx is None else f'{mx:.2e}'} |")
    return "\n".join(rows)


def floor_section(model_dir: Path, golden: Path | None) -> dict[str, object]:
    """The machine's floor, then each stage's paths against it, printed as they are measured; the report's part."""
    floor = machine_floor()
    print("floor (1 thread, CPU time)", json.dumps({k: round(v, 2) for k, v in floor.items()}), flush=True)
    paths = dit_paths(model_dir, golden)
    print(floor_table(floor, paths), flush=True)
    llm, vocoder = llm_paths(model_dir), vocoder_path(model_dir)
    print(stage_floor_table(floor, llm, vocoder), flush=True)
    return {"floor": floor, "dit_paths": paths, "llm_paths": llm, "vocoder": vocoder}
