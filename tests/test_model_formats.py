"""Every file format and tensor type floe reads gives the logits transformers gives on the same file."""

import hashlib
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from models import save_hf_folder, write_gguf
from safetensors import safe_open
from safetensors.torch import save_file

from floe import snapshot
from floe.engine import Engine
from floe.errors import ModelNotFound, NotAModel, UnsupportedModel
from floe.model import load_checkpoint
from floe.model.gguf_file import GGUFFile

IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions


def transformers_logits(folder, ids, gguf_file=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0]


def floe_logits(path, ids, dtype=torch.float32):
    engine = Engine(load_checkpoint(path, dtype), dtype=dtype, max_seq_len=128)
    return engine.prefill(ids, all_logits=True)


@pytest.mark.parametrize(
    "qtypes",
    [[Q.Q4_0, Q.Q4_1, Q.Q8_0], [Q.Q4_K, Q.Q5_K, Q.Q6_K], [Q.F16, Q.BF16, Q.F32], [Q.Q5_0, Q.Q2_K, Q.Q3_K]],
    ids=lambda qs: "+".join(q.name for q in qs),
)
def test_gguf_tensor_types_match_transformers(tmp_path, qtypes):
    path = write_gguf(tmp_path / "tiny.gguf", qtypes)
    checkpoint = load_checkpoint(path)
    assert set(checkpoint.file_type.split("+")) == {q.name for q in qtypes} - {"F32"} or qtypes == [Q.F32]
    ref = transformers_logits(tmp_path, IDS, gguf_file="tiny.gguf")
    ours = floe_logits(path, IDS)
    assert ref.abs().max() > 0.5  # the comparison means something
    # fp32 with another summation order: random K-quant blocks give logits in the thousands, where
    # one rounding is ~1e-4 of a unit (the order depends on the CPU's GEMM kernels).
    assert (ours - ref).abs().max().item() <= 1e-4 + 1e-5 * ref.abs().max().item()


def test_gguf_loads_to_bfloat16(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", [Q.Q8_0])
    checkpoint = load_checkpoint(path, torch.bfloat16)
    assert all(w.dtype == torch.bfloat16 for w in checkpoint.weights.values())
    ours, ref = floe_logits(path, IDS, torch.bfloat16), floe_logits(path, IDS)
    assert torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min() > 0.99


@pytest.mark.parametrize(
    "arch,tie,llama3", [("llama", False, True), ("llama", True, False), ("qwen2", True, False),
                        ("qwen2", False, False)]
)
def test_hf_folder_matches_transformers(tmp_path, arch, tie, llama3):
    folder = save_hf_folder(tmp_path, arch, tie=tie, rope_llama3=llama3)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded
    checkpoint = load_checkpoint(folder)
    assert checkpoint.config.tie_embeddings == tie
    assert checkpoint.config.qkv_bias == (arch == "qwen2")
    assert (checkpoint.config.rope_scaling is not None) == llama3
    ref = transformers_logits(folder, IDS)
    assert (floe_logits(folder, IDS) - ref).abs().max().item() <= 1e-4


def test_llama3_rope_scaling_changes_the_result(tmp_path):
    """The llama3 scaling test above would pass vacuously if scaling did nothing at 48 positions."""
    folder = save_hf_folder(tmp_path, "llama", tie=False, rope_llama3=True)
    scaled = floe_logits(folder, IDS)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert (floe_logits(folder, IDS) - scaled).abs().max().item() > 1e-3


def test_incremental_decode_equals_one_shot_prefill(tmp_path):
    folder = save_hf_folder(tmp_path, "qwen2", tie=True)
    engine = Engine(load_checkpoint(folder), max_seq_len=128)
    full = engine.prefill(IDS, all_logits=True)
    engine.kv_truncate(0)
    engine.prefill(IDS[:10])
    engine.prefill(IDS[10:30])  # appending a chunk to an existing prefix
    steps = [engine.decode_step(t) for t in IDS[30:]]
    torch.testing.assert_close(torch.stack(steps), full[30:], atol=1e-5, rtol=0)


def test_fingerprint_is_stable_and_sensitive_to_weights(tmp_path):
    a = write_gguf(tmp_path / "a.gguf", [Q.Q8_0], seed=1)
    b = write_gguf(tmp_path / "b.gguf", [Q.Q8_0], seed=2)
    assert load_checkpoint(a).fingerprint == load_checkpoint(a).fingerprint
    assert load_checkpoint(a).fingerprint != load_checkpoint(b).fingerprint
    assert len(load_checkpoint(a).fingerprint) == 64


def test_fingerprint_changes_with_one_weight_byte_and_not_with_the_dtype(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", [Q.Q4_0])
    before = load_checkpoint(path)
    assert load_checkpoint(path, torch.bfloat16).fingerprint == before.fingerprint
    data = bytearray(path.read_bytes())
    data[-5000] ^= 1  # one bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    assert load_checkpoint(path).fingerprint != before.fingerprint


# The default model's fingerprint as floe computed it before scheme v2 (SHA-256 of every byte), and
# after (XXH3-128 of each tensor's bytes under the SHA-256): each a pass over the same 98 MB.
DEFAULT_V1 = "211578811c8d58fce3595b3518f69b0fb963052b79a8b1905ab55df6c8a3013b"
DEFAULT_V2 = "bad233e086f025c7a89cfa221d33e7018716abfc13e234e8f1ab985bcdba82f7"


def test_the_default_models_fingerprints_by_both_schemes(default_checkpoint):
    assert default_checkpoint.fingerprint == DEFAULT_V2
    assert default_checkpoint.legacy_fingerprint() == DEFAULT_V1


def test_an_hf_folders_fingerprint_keeps_its_v1_value_for_old_snapshots(tmp_path):
    folder = save_hf_folder(tmp_path, "qwen2", tie=True)
    checkpoint = load_checkpoint(folder)
    legacy = hashlib.sha256(b"floe-model-v1\0" + checkpoint.config.to_json().encode())
    tensors = {}
    for shard in folder.glob("*.safetensors"):  # the names sorted across shards, as v1 took them
        with safe_open(str(shard), framework="pt") as f:
            tensors.update((name, f.get_tensor(name)) for name in f.keys())
    for name, t in sorted(tensors.items()):
        legacy.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        legacy.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert checkpoint.legacy_fingerprint() == legacy.hexdigest() != checkpoint.fingerprint


def test_a_snapshot_made_under_fingerprint_scheme_v1_still_thaws_and_verifies(tmp_path, capsys):
    """Snapshots record the model's fingerprint; those written before scheme v2 hold the v1 value."""
    from floe.actor import Actor
    from floe.cli import main
    from floe.snapshot import SnapshotModelMismatch, seal

    engine = Engine(load_checkpoint(write_gguf(tmp_path / "m.gguf", [Q.Q8_0])), max_seq_len=64)
    with Actor(engine) as actor:
        actor.send("Hi", max_tokens=3)
        snapshot.freeze(actor, tmp_path / "new.safetensors")
    for name, fingerprint in (("old", engine.checkpoint.legacy_fingerprint()), ("other", "0" * 64)):
        with safe_open(str(tmp_path / "new.safetensors"), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, {**f.metadata()}
        meta["model_fingerprint"] = fingerprint
        seal(tensors, meta)
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), metadata=meta)
    with snapshot.thaw(engine, tmp_path / "old.safetensors") as actor:
        assert actor.send("And?", max_tokens=2).stats.generated_tokens >= 1
    with pytest.raises(SnapshotModelMismatch, match="load the same model file"):
        snapshot.thaw(engine, tmp_path / "other.safetensors")
    model = str(tmp_path / "m.gguf")
    assert main(["snapshot", "verify", str(tmp_path / "old.safetensors"), "--model", model]) == 0
    assert "ok (" in capsys.readouterr().out
    assert main(["snapshot", "verify", str(tmp_path / "other.safetensors"), "--model", model]) == 1


def test_unsupported_architecture_is_named(tmp_path):
    folder = save_hf_folder(tmp_path, "llama", tie=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="'gpt2'.*GPT2LMHeadModel"):
        load_checkpoint(folder)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", [Q.F32], arch="falcon")
    with pytest.raises(UnsupportedModel, match="'falcon'"):
        load_checkpoint(path)


def test_tensor_type_gguf_cannot_dequantize_is_named(tmp_path):
    extra = {"blk.0.attn_q.bias": (np.zeros(256, dtype=np.int8), Q.I8)}
    path = write_gguf(tmp_path / "t.gguf", [Q.F32], extra_tensors=extra)
    with pytest.raises(UnsupportedModel, match="I8"):
        load_checkpoint(path)


def test_truncated_gguf_is_not_a_model(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", [Q.Q8_0])
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(NotAModel, match="truncated or corrupt"):
        load_checkpoint(cut)


def test_gguf_string_arrays_read_back_as_written(tmp_path):
    """A GGUF's arrays of strings (a vocabulary's tokens, kept as the file's bytes) read as the writer's
    list: every string in order, by index from either end and by slice; one that is not UTF-8 is refused."""
    tokens = ["<s>", "é", "Ġthe", "", "日本", "a b"]
    read = GGUFFile(_strings_gguf(tmp_path / "s.gguf", tokens)).fields["tokenizer.ggml.tokens"]
    assert len(read) == len(tokens) and list(read) == tokens
    assert [read[i] for i in range(-len(tokens), len(tokens))] == tokens * 2
    assert read[1:5:2] == tokens[1:5:2]
    with pytest.raises(IndexError):
        read[len(tokens)]
    with pytest.raises(NotAModel, match="truncated or corrupt"):
        GGUFFile(_strings_gguf(tmp_path / "bad.gguf", [b"ok", b"\xff"]))


def _strings_gguf(path, tokens):
    writer = GGUFWriter(path, "llama")
    writer.add_token_list(tokens)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_paths_and_non_models(tmp_path):
    with pytest.raises(ModelNotFound):
        load_checkpoint(tmp_path / "nope.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(NotAModel, match="not a GGUF file"):
        load_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(NotAModel, match="config.json"):
        load_checkpoint(tmp_path)
