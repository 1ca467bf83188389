"""Memory in mappings of its own (cosyvoice.system.pages). A mapped checkpoint's pages handed back once the weights
read from them are replaced (cosyvoice.weights.give_back): the resident set shrinks, the bytes stay what the file
holds, and memory that is not a checkpoint's is never touched; the int8 paths quantise a parent module at a time
to hand pages back as they go, with the weights quantising the whole model at once gives. A zeroed buffer in a
mapping (the LLM's key/value slots, a stream's DiT cache) is resident only where written and gone with its tensor."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import pytest
import torch

from cosyvoice.bundle import open_model_dir
from cosyvoice.llm.qwen2 import KVCache
from cosyvoice.system.pages import PAGE, mapped_zeros
from cosyvoice.weights import give_back, read_checkpoint
from tests.memory_probe import rss_bytes

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")


def resident_bytes_of(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5] == str(path.resolve())
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_a_replaced_weights_pages_leave_the_resident_set_and_its_bytes_stay_the_files(tiny_bundle_dir: Path) -> None:
    path = tiny_bundle_dir / "llm.pt"
    sd = read_checkpoint(path)
    weight = max(sd.values(), key=lambda t: t.nbytes)  # the text embedding: many whole pages
    assert weight.nbytes > 64 * PAGE
    expected = weight.clone()
    float(weight.sum())  # read: its pages become resident
    before = resident_bytes_of(path)
    dropped = give_back([weight])
    after = resident_bytes_of(path)
    assert dropped >= weight.nbytes - 2 * PAGE  # all but the pages it may share with its neighbours
    assert before - after >= dropped - 2 * PAGE
    assert torch.equal(weight, expected)  # read again: faulted back in from the file


def test_memory_that_is_not_a_mapped_checkpoint_is_never_dropped() -> None:
    weight = torch.randn(256, 1024)  # 1 MiB of the heap or an anonymous mapping
    expected = weight.clone()
    assert give_back([weight, expected[:10]]) == 0
    assert torch.equal(weight, expected)


def test_the_llm_quantised_a_parent_at_a_time_holds_the_weights_of_quantising_it_at_once(tiny_bundle_dir: Path) -> None:
    from torch.ao.quantization import quantize_dynamic

    from cosyvoice.backends.quant import quantize_llm

    bundle = open_model_dir(tiny_bundle_dir)
    ours = quantize_llm(bundle.load_llm())
    whole = bundle.load_llm()
    names = {n for n, m in whole.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = quantize_dynamic(whole, names, dtype=torch.qint8, inplace=True)
    quantised = {n: m for n, m in whole.named_modules() if n in names}
    assert quantised and all(not isinstance(m, torch.nn.Linear) for m in quantised.values())
    for name, module in quantised.items():
        mine = ours.get_submodule(name)
        assert type(mine) is type(module)
        assert torch.equal(mine.weight().int_repr(), module.weight().int_repr())
        assert mine.weight().q_scale() == module.weight().q_scale()
        assert torch.equal(mine.bias(), module.bias()) if module.bias() is not None else mine.bias() is None


def test_a_mapped_buffer_is_zeros_resident_only_where_written_and_gone_with_its_tensor() -> None:
    before = rss_bytes()
    buffer = mapped_zeros((64, 1024, 1024), torch.float32)  # 256 MiB of address space
    assert rss_bytes() - before < 16 * 2**20
    assert not buffer[::7, ::97].any()  # zeros where never written
    buffer[:8] = 1.0  # 32 MiB written
    written = rss_bytes() - before
    assert 30 * 2**20 < written < 64 * 2**20
    view = buffer[:2]
    del buffer
    gc.collect()
    assert float(view.sum()) == 2 * 1024 * 1024  # a view keeps the mapping
    del view
    gc.collect()
    assert rss_bytes() - before < written - 24 * 2**20


def test_the_llm_key_value_slots_start_zero_and_hold_what_is_written(tiny_bundle_dir: Path) -> None:
    cfg = open_model_dir(tiny_bundle_dir).config.llm.qwen
    cache = KVCache.allocate(cfg, batch=3, max_len=64)
    assert cache.k.shape == (cfg.num_hidden_layers, 3, cfg.num_key_value_heads, 64, cfg.head_dim)
    assert not cache.k.any() and not cache.v.any()
    k = torch.randn(1, cfg.num_key_value_heads, 2, cfg.head_dim)
    keys, _ = cache.view(1, 2, 8).update(0, torch.tensor([[3, 4]]), k, -k)
    assert torch.equal(keys[:, :, 3:5], k) and not keys[:, :, :3].any()
    assert torch.equal(cache.v[0, 1, :, 3:5], -k[0]) and not cache.k[0, 0].any() and not cache.k[0, 2].any()
