"""LoRA adapters on the NumPy backend: every family against the naive reference (W + scale · B·A on the base),
llama.cpp's adapter rules (scale = alpha / rank × user scale, alpha 0 = user scale, several adapters add up), and
the typed errors for a mismatched or malformed adapter, raised before a backend is built."""

from __future__ import annotations

import numpy as np
import pytest

from engine import lora
from engine.engine import Engine
from engine.errors import GGUFError, InvalidInput, UnsupportedArchitecture
from engine.gguf import read
from tests import conformance as C
from tests import lora_util, synthetic

F32 = {arch: C.fixture_path(f"{name}-tiny-f32", ".gguf")
       for arch, name in (("qwen3", "qwen3"), ("qwen3moe", "qwen3moe"), ("qwen35", "qwen35"),
                          ("deepseek2", "deepseek2"))}  # fmt: skip
IDS = [998, 12, 400, 77, 531, 9, 250, 868, 33, 101, 640, 2, 45]


def _adapter(tmp_path, arch: str, rank: int, seed: int, alpha: float, base: str | None = None, **kw):
    gf = read(base or F32[arch])
    pairs = lora_util.random_pairs(gf, lora_util.TARGETS[arch], rank, seed)
    path = lora_util.write_adapter(tmp_path / f"{arch}-r{rank}-{seed}.gguf", arch, pairs, alpha, **kw)
    return path, pairs


def _engine_logits(path: str, adapters, prefill: int) -> np.ndarray:
    e = Engine.load(path, backend="cpu", max_seq_len=64, lora=adapters)
    return e.logits(IDS, prefill=prefill)


@pytest.mark.parametrize("arch", sorted(F32))
def test_every_family_matches_the_merged_reference(tmp_path, arch):
    path, pairs = _adapter(tmp_path, arch, 8, seed=3, alpha=16.0)
    want = synthetic.logits(lora_util.merged_runner(F32[arch], [(pairs, 0.5 * 16.0 / 8)]), IDS, 5)
    got = _engine_logits(F32[arch], [(path, 0.5)], prefill=5)  # a batch, then the decode path
    base = _engine_logits(F32[arch], None, prefill=5)
    assert float(np.abs(got - want).max()) <= 1e-4
    assert float(np.abs(base - want).max()) > 1e-2  # the adapter did change the model


def test_quantized_base_keeps_its_blocks_and_gets_the_update(tmp_path):
    q8 = C.fixture_path("qwen3-tiny-q8_0", ".gguf")
    path, pairs = _adapter(tmp_path, "qwen3", 8, seed=4, alpha=8.0, base=q8)
    want = synthetic.logits(lora_util.merged_runner(q8, [(pairs, 1.0)]), IDS, len(IDS))
    assert float(np.abs(_engine_logits(q8, [(path, 1.0)], len(IDS)) - want).max()) <= 1e-4


def test_alpha_zero_means_the_user_scale_and_adapters_add_up(tmp_path):
    p1, pairs1 = _adapter(tmp_path, "qwen3", 8, seed=5, alpha=0.0)
    p2, pairs2 = _adapter(tmp_path, "qwen3", 16, seed=6, alpha=4.0)
    want = synthetic.logits(lora_util.merged_runner(F32["qwen3"], [(pairs1, 0.8), (pairs2, -1.5 * 4 / 16)]),
                            IDS, len(IDS))  # fmt: skip
    got = _engine_logits(F32["qwen3"], [(p1, 0.8), (p2, -1.5)], len(IDS))
    assert float(np.abs(got - want).max()) <= 1e-4


def test_f16_adapter_and_an_untied_output_head(tmp_path):
    # The llama path with its own output.weight (the tiny fixtures tie it), F16 adapter tensors.
    path = str(tmp_path / "llama.gguf")
    from tests.test_cuda_llama import VOCAB, write_llama

    write_llama(path, "F32", seed=11)
    gf = read(path)
    pairs = lora_util.random_pairs(gf, lora_util.TARGETS["llama"], 8, seed=12)
    pairs16 = {k: (a.astype(np.float16), b.astype(np.float16)) for k, (a, b) in pairs.items()}
    adapter = lora_util.write_adapter(tmp_path / "a16.gguf", "llama", pairs16, 8.0, dtype=np.float16)
    exact = {k: (a.astype(np.float32), b.astype(np.float32)) for k, (a, b) in pairs16.items()}
    ids = [i % VOCAB for i in IDS]
    want = synthetic.logits(lora_util.merged_runner(path, [(exact, 1.0)]), ids, 4)
    r = synthetic.runner(path, 64)
    from engine.cpu import lora as cpu_lora

    assert cpu_lora.attach(r.model, lora.open_adapters([(adapter, 1.0)], gf)) == len(pairs)
    assert float(np.abs(synthetic.logits(r, ids, 4) - want).max()) <= 1e-4
    # gathered LM-head rows (system1's path) see the output adapter too
    r.reset()
    nxt = [*ids[1:], 0]
    assert float(np.abs(r.forward(ids, "all", nxt) - want[np.arange(len(ids)), nxt]).max()) <= 1e-4


def test_spec_parsing():
    assert lora.parse_spec("a.gguf") == ("a.gguf", 1.0)
    assert lora.parse_spec("/x/a.gguf:0.5") == ("/x/a.gguf", 0.5)
    assert lora.parse_spec("/x:y/a.gguf") == ("/x:y/a.gguf", 1.0)
    assert lora.parse_env(" a.gguf:2, b.gguf ") == [("a.gguf", 2.0), ("b.gguf", 1.0)]
    assert lora.parse_env("") == []
    with pytest.raises(InvalidInput, match="LORA_ADAPTERS"):
        lora.parse_env("a.gguf:nan")


def _expect(tmp_path, kind, match, pairs=None, arch="qwen3", **kw):
    gf = read(F32["qwen3"])
    pairs = pairs if pairs is not None else lora_util.random_pairs(gf, ["attn_q"], 4, seed=1)
    path = lora_util.write_adapter(tmp_path / "bad.gguf", arch, pairs, 8.0, **kw)
    with pytest.raises(kind, match=match) as info:
        Engine.load(F32["qwen3"], backend="cpu", lora=[(path, 1.0)])
    return info.value


def test_mismatched_adapters_are_typed_errors(tmp_path):
    gf = read(F32["qwen3"])
    a, b = lora_util.random_pairs(gf, ["attn_q"], 4, seed=1)["blk.0.attn_q.weight"]
    assert _expect(tmp_path, InvalidInput, "architecture 'llama'", arch="llama").kind == "invalid_input"
    _expect(tmp_path, InvalidInput, "does not have", pairs={"blk.7.attn_q.weight": (a, b)})
    _expect(tmp_path, InvalidInput, "does not fit", pairs={"blk.0.attn_k.weight": (a, b)})  # k has 128 rows
    _expect(tmp_path, InvalidInput, "does not fit", pairs={"blk.0.attn_q.weight": (a, b[:, :3])})  # rank 4 vs 3
    _expect(tmp_path, UnsupportedArchitecture, "not supported", pairs={"token_embd.weight": (a, b)})
    assert _expect(tmp_path, GGUFError, "not a LoRA adapter", general_type="model").kind == "gguf"
    with pytest.raises(InvalidInput, match="no such file"):
        Engine.load(F32["qwen3"], backend="cpu", lora=[(str(tmp_path / "missing.gguf"), 1.0)])


def test_a_half_pair_or_a_foreign_tensor_is_a_bad_file(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "half.gguf"), "qwen3")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 256), np.float32))
    w.add_tensor("blk.0.attn_q.weight.extra", np.zeros((4,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"neither \.lora_a nor \.lora_b"):
        Engine.load(F32["qwen3"], backend="cpu", lora=[(str(tmp_path / "half.gguf"), 1.0)])
