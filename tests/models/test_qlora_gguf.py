"""QLoRA on a ``.gguf`` file's own blocks (``model.quantize: gguf``, `jaxtune.models.gguf_blocks`): the adapted
kernels kept on the device as llama.cpp quantized them, never dequantized and quantized again.

Tolerances (why they are what they are):
  * decoded blocks (value * scale + offset, float32) vs the gguf package's reference dequantizers: bitwise equal.
    Every product scale * value is exact in float32 (at most 11 + 7 + 6 = 24 significant bits) and the one addition
    of an offset rounds as the reference's does; random bytes (every bit pattern of values and sub-block scales) and
    real tensors alike.
  * logits of a model on the blocks vs the same model loaded without model.quantize from the file's converted
    directory (whose weights are the gguf package's dequantized values): rel <= 1e-6 (measured 0: the same float32
    weights reach the same matmuls).
  * a QLoRA SFT run on them: the loss falls (last < first), its merged export reloads with the run's logits
    (rel <= 1e-5), its PEFT adapter directory is written.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compare import rel
from helpers.gguf_files import finish_gguf
from helpers.real_models import GEMMA3_270M_INSTALL, SMOLLM2_INSTALL, gemma3_270m_gguf, smollm2_gguf
from helpers.tiny_hf import IDS, TEXTS, save_chatml_tokenizer, save_perturbed

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import ConfigError, load_config
from jaxtune.models.quantize import GGUFBlocks, is_quantized

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from jaxtune.models.gguf_blocks import FORMATS, decode, raw_rows, read_header

Q = gguf.GGMLQuantizationType
MESH = sharding.make_mesh(1, 1, 1, jax.devices()[:1])
# Where each type's float16 fields lie in its block (byte offsets): random bytes get finite values there.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82)}


def random_blocks(kind: str, rows: int, inputs: int, rng: np.random.Generator, d: float = 1.0) -> np.ndarray:
    """Random bytes of a (rows, inputs) tensor of type ``kind``: every bit pattern of values and sub-block scales,
    the float16 scales replaced by ``d`` times a random number in [0.5, 1) (finite; subnormal ones too when d is
    small)."""
    size, type_size = gguf.GGML_QUANT_SIZES[Q[kind]]
    raw = rng.integers(0, 256, (rows * inputs // size, type_size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[:, at:at + 2] = (d * rng.uniform(0.5, 1.0, len(raw))).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def decoded(v: np.ndarray, s: np.ndarray, o: np.ndarray | None) -> np.ndarray:
    """value * scale + offset, blocks along the rows' inputs (float32, in numpy)."""
    rows, inputs = v.shape
    x = v.astype(np.float32).reshape(rows, s.shape[1], inputs // s.shape[1]) * s[:, :, None]
    return (x if o is None else x + o[:, :, None]).reshape(rows, inputs)


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_mapped_type_decodes_to_the_reference_dequantizer(kind):
    """Random blocks of each mapped type, and (for the types the gguf package quantizes) a quantized Gaussian
    matrix: our (values, scale, offset) give the reference's float32 weights bitwise, values within the type's
    range."""
    rng = np.random.default_rng(0)
    raw = random_blocks(kind, 6, 512, rng)
    v, s, o = decode(raw, kind)
    ref = gguf.quants.dequantize(raw, Q[kind])
    assert np.array_equal(decoded(v, s, o), ref)
    f = FORMATS[kind]
    assert v.min() >= f.lo and v.max() <= f.hi and (o is not None) == f.offset and s.shape == (6, 512 // f.block)
    assert v.min() == f.lo and v.max() == f.hi  # random bytes reach both ends: the range is the type's
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = rng.normal(0, 0.02, (16, 256)).astype(np.float32)
        q = gguf.quants.quantize(w, Q[kind])
        assert np.array_equal(decoded(*decode(q, kind)), gguf.quants.dequantize(q, Q[kind]))


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_tensors_decode_to_the_reference_dequantizer(which):
    """Every tensor of a mapped type in the real files (SmolLM2-135M: Q4_1, Q8_0; Gemma 3 270M Q4_K_M: Q4_K, Q5_0,
    Q6_K, Q8_0; the embeddings' first 4096 rows), read from the header without gguf's reader: bitwise equal."""
    path = smollm2_gguf() if which == "smollm2" else gemma3_270m_gguf()
    if path is None:
        pytest.skip(f"wheel absent ({SMOLLM2_INSTALL if which == 'smollm2' else GEMMA3_270M_INSTALL})")
    _, tensors = read_header(path)
    seen = set()
    for t in tensors.values():
        if t.type_name not in FORMATS:
            continue
        raw = raw_rows(path, t)[:4096]
        assert np.array_equal(decoded(*decode(raw, t.type_name)), gguf.quants.dequantize(raw, Q[t.type_name])), t.name
        seen.add(t.type_name)
    assert seen == ({"Q4_1", "Q8_0"} if which == "smollm2" else {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})


# --- a tiny Llama whose file mixes every mapped type across layers, as a Q4_K_M file does ---

# (layer 0, layer 1) per projection, and the common form of the stacked kernel: (values, block, offset)
MIXED = {"attn_q": ("Q4_0", "Q4_0", "int4", 32, False), "attn_k": ("Q4_1", "Q4_K", "uint4", 32, True),
         "attn_v": ("Q5_0", "Q8_0", "int8", 32, False), "attn_output": ("Q5_1", "Q5_K", "int8", 32, True),
         "ffn_gate": ("Q8_0", "Q6_K", "int8", 16, False), "ffn_up": ("Q4_K", "Q4_1", "uint4", 32, True),
         "ffn_down": ("Q6_K", "Q4_K", "int8", 16, True)}
K_SCALE = {"Q4_K": 2e-5, "Q5_K": 1e-5, "Q6_K": 5e-6, "Q2_K": 1e-4}  # random K-quant blocks of weights ~0.02


def retyped(src: Path, dst: Path, types: dict[str, str], seed: int = 0) -> Path:
    """A copy of the GGUF ``src`` with the tensors ``types`` names in other types: the ones gguf quantizes from
    the dequantized weights, the K-quants (which it cannot) as random blocks of a similar scale."""
    rng = np.random.default_rng(seed)
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        kind = types.get(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        if kind is None:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        elif kind in K_SCALE:
            w.add_tensor(t.name, random_blocks(kind, *shape, rng, K_SCALE[kind]), raw_dtype=Q[kind])
        else:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            w.add_tensor(t.name, gguf.quants.quantize(np.ascontiguousarray(x), Q[kind]), raw_dtype=Q[kind])
    finish_gguf(w)
    return dst


@pytest.fixture(scope="module")
def root(gguf_module_root):
    """The module's directory, jaxtune's GGUF import cache in it."""
    return gguf_module_root


@pytest.fixture(scope="module")
def tiny_files(root):
    """(mixed, f16): a tiny random Llama (2 layers, d_model 256, d_ff 512: K-quant blocks of 256 fit) exported
    with jaxtune's exporter (f32; f16), the f32 file's projections then retyped per `MIXED`."""
    import transformers

    from jaxtune.models.gguf_export import write_gguf

    hf = root / "hf-llama"
    hf.mkdir()
    vocab = save_chatml_tokenizer(hf, TEXTS)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0,
                                      attn_implementation="eager")
    save_perturbed(lambda: transformers.LlamaForCausalLM(config), hf)
    plain = write_gguf(hf, root / "tiny-f32.gguf", "f32")
    mixed = retyped(plain, root / "tiny-mixed.gguf",
                    {f"blk.{i}.{stem}.weight": kinds[i] for stem, kinds in MIXED.items() for i in (0, 1)})
    return mixed, write_gguf(hf, root / "tiny-f16.gguf", "f16")


def logits_pair(source: str, extra: list[str], ids: np.ndarray):
    """(float logits: the converted directory loaded without model.quantize, gguf logits, the gguf spec, its base)
    of one LoRA model (rank 8, its adapters as initialised)."""
    over = [f"model.from_hf={source}", "model.lora.rank=8", *extra]
    f_spec = make_state_spec(load_config(None, over), None, MESH)
    g_spec = make_state_spec(load_config(None, [*over, "model.quantize=gguf"]), None, MESH)
    params = f_spec.init(0).params
    batch = {"inputs": jnp.asarray(ids, jnp.int32)}
    f = np.asarray(f_spec.forward().logits(f_spec.weights(params, f_spec.load_frozen(0)), batch))
    g_frozen = g_spec.load_frozen(0)
    g = np.asarray(g_spec.forward().logits(g_spec.weights(params, g_frozen), batch))
    return f, g, g_spec, g_frozen


@pytest.mark.parametrize("scan", [False, True])
def test_mixed_file_blocks_give_the_float_models_logits(tiny_files, scan):
    """Per layer (each kernel its own type) and stacked (model.scan_layers: one common form per kernel, `MIXED`),
    q/k un-permuted like the float import: the logits equal the float model's; the layout planned from the header
    is what is loaded."""
    mixed, _ = tiny_files
    f, g, spec, (base,) = logits_pair(str(mixed), [f"model.scan_layers={str(scan).lower()}"], IDS)
    assert rel(g, f) <= 1e-6, rel(g, f)
    blocks = [x for x in jax.tree.leaves(base, is_leaf=is_quantized) if is_quantized(x)]
    assert all(isinstance(x, GGUFBlocks) for x in blocks) and len(blocks) == (7 if scan else 14)
    planned = jax.tree.leaves(spec.frozen_abstract, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    loaded = jax.tree.leaves(base)
    assert [(a.shape, a.dtype) for a in planned] == [(x.shape, x.dtype) for x in loaded]
    if scan:
        by_stem = {"attn_q": ("attn", "q"), "attn_k": ("attn", "k"), "attn_v": ("attn", "v"),
                   "attn_output": ("attn", "o"), "ffn_gate": ("mlp", "gate"), "ffn_up": ("mlp", "up"),
                   "ffn_down": ("mlp", "down")}
        for stem, (*_, dtype, block, offset) in MIXED.items():
            a, b = by_stem[stem]
            k = base["layers"][a][b]["kernel"]
            assert (str(k.qvalue.dtype), k.qvalue.shape[-2] // k.scale.shape[-2], k.offset is not None) == \
                (dtype, block, offset), stem


def test_qlora_sft_on_the_files_blocks(tiny_files, root):
    """A QLoRA SFT run (rank 8, 6 steps, stacked layers) on the mixed file's blocks: the loss falls; the merged
    export (dequantized base + adapters) reloads with the run's logits, and the PEFT adapter directory is written."""
    from helpers.run_outputs import losses

    from jaxtune.cli import main
    from jaxtune.models import from_hf
    from jaxtune.models.registry import merge
    from jaxtune.run import load_run

    mixed, _ = tiny_files
    text = root / "train.txt"
    text.write_text("\n".join(TEXTS * 20))
    cfg = load_config(None, [f"model.from_hf={mixed}", "model.lora.rank=8", "model.lora.alpha=16",
                             "model.quantize=gguf", "model.scan_layers=true", f"data.sources=[{text}]",
                             f"data.cache_dir={root / 'data-cache'}", "data.seq_len=16", "data.val_fraction=0",
                             "train.steps=6", "train.batch_size=4", "optim.lr=1e-2", "optim.warmup_steps=1",
                             "eval.every=0", "checkpoint.every=6", "logging.every=1", "logging.progress=false",
                             "logging.tensorboard=false", f"run_dir={root / 'qlora-gguf-run'}"])
    from jaxtune.loop import train

    train(cfg)
    got = [loss for _, loss in sorted(losses(cfg.run_path).items())]
    print("QLoRA gguf SFT losses", got)
    assert len(got) == 6 and got[-1] < got[0] - 0.1, got
    merged, adapter = root / "exports" / "merged", root / "exports" / "adapter"
    assert main(["export", str(cfg.run_path), str(merged)]) == 0
    assert main(["export", str(cfg.run_path), str(adapter), "--adapter"]) == 0
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    run = load_run(cfg.run_path)
    assert any(isinstance(x, GGUFBlocks) for x in jax.tree.leaves(run.frozen, is_leaf=is_quantized))
    ids = jnp.asarray(IDS[:, :16], jnp.int32)
    ours = np.asarray(merge(run.spec.graphdef, run.weights)(ids))
    assert rel(np.asarray(from_hf(merged)(ids)), ours) <= 1e-5


@pytest.mark.parametrize("which", [pytest.param("gemma3", marks=pytest.mark.slow), "smollm2"])  # ~40 s, ~12 s
def test_real_file_blocks_logits_and_memory(which):
    """Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0 mixed across layers, stacked) and SmolLM2-135M Q4_1 (Llama: q/k
    un-permuted): logits on the file's blocks equal the float model's on 200 tokens. The adapted kernels' bytes on
    the device (as the plan counts them: 4-bit values at half a byte) against float32 and nf4: printed, and checked
    against the types (Gemma: Q5_0/Q8_0 q k v gate up in int8 with a scale per 32, so above nf4; SmolLM2: Q4_1 in
    uint4 with scale and offset per 32, 0.25 of float32's bytes + 1/8)."""
    path = smollm2_gguf() if which == "smollm2" else gemma3_270m_gguf()
    if path is None:
        pytest.skip(f"wheel absent ({SMOLLM2_INSTALL if which == 'smollm2' else GEMMA3_270M_INSTALL})")
    source = "wheel:smollm2-135m-instruct" if which == "smollm2" else "wheel:gemma3-270m"
    ids = (np.arange(1, 201) * 37 % 5000)[None]
    f, g, spec, _ = logits_pair(source, ["model.scan_layers=true"], ids)
    assert rel(g, f) <= 1e-6, rel(g, f)

    def kernel_bytes(kind: str | None) -> int:
        over = [f"model.from_hf={source}", "model.lora.rank=8", "model.scan_layers=true"]
        s = spec if kind == "gguf" else make_state_spec(
            load_config(None, over + ([f"model.quantize={kind}"] if kind else [])), None, MESH)
        layers = s.frozen_abstract[0]["layers"]
        return sum(sharding.shard_bytes(a) for a in jax.tree.leaves({k: layers[k] for k in ("attn", "mlp")})
                   if a.ndim == 3)

    full, blocks, nf4 = kernel_bytes(None), kernel_bytes("gguf"), kernel_bytes("nf4")
    print(f"{which}: adapted kernels float32 {full / 2**20:.1f} MiB, gguf blocks {blocks / 2**20:.1f} MiB, "
          f"nf4 {nf4 / 2**20:.1f} MiB")
    if which == "smollm2":
        n = full // 4
        assert blocks == n // 2 + n // 32 * 8, (blocks, n)
    else:
        assert nf4 < blocks < full * 0.4, (full, blocks, nf4)


def test_refusals(tiny_files, root):
    """model.quantize=gguf on a checkpoint that is not a .gguf file, or none; a file whose adapted kernel is F16
    (the exporter's f16) or Q2_K (the mixed file, one layer's ffn_down retyped: a type with no map): one line each,
    naming the file, the tensor, its type, the mapped types and what to do."""
    mixed, f16 = tiny_files
    with pytest.raises(ConfigError, match=r"model.quantize=gguf keeps a .gguf file's own quantized blocks, and "
                                          r"model.from_hf=/some/dir is not one; set model.from_hf to a .gguf file"):
        load_config(None, ["model.from_hf=/some/dir", "model.lora.rank=8", "model.quantize=gguf"])
    with pytest.raises(ConfigError, match="model.from_hf is not set"):
        load_config(None, ["model.lora.rank=8", "model.quantize=gguf"])
    q2k = retyped(mixed, root / "tiny-q2k.gguf", {"blk.1.ffn_down.weight": "Q2_K"})
    for path, tensor, kind in ((f16, "blk.0.attn_k.weight", "F16"), (q2k, "blk.1.ffn_down.weight", "Q2_K")):
        cfg = load_config(None, [f"model.from_hf={path}", "model.lora.rank=8", "model.quantize=gguf",
                                 "model.lora.targets=[down]" if kind == "Q2_K" else "model.lora.targets=all"])
        with pytest.raises(ConfigError) as e:
            make_state_spec(cfg, None, MESH)
        msg = str(e.value)
        assert "\n" not in msg and f"{path}: tensor {tensor} is {kind}, which has no map" in msg, msg
        assert "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K" in msg and "model.quantize=nf4" in msg, msg
