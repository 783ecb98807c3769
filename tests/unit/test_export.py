"""ray_train_tpu.checkpoint.export_hf: sharded checkpoints -> Hugging Face directories, checked bit for bit.

The checkpoints are written by 2 gloo processes of a simulated TPU host
(ray_train_tpu.testing.gloo) with FSDP2 (one AdamW step, as the GRPO trainer
saves) and with tensor parallelism; the FSDP2 one is exported by the same 2
ranks (files shared out), the TP one by this process. The exported safetensors
must equal the trainer's full state dict, and a model loaded from the export by
transformers must hold those weights and answer greedy prompts token for token
as the in-memory model does.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from ray_train_tpu import checkpoint
from ray_train_tpu.checkpoint import ExportError, export_hf
from ray_train_tpu.checkpoint._hf_names import hf_names
from ray_train_tpu.testing import gloo as _spawn

FILE_BYTES = 200_000  # the tiny model (about 0.6 MB) is cut into several files


def _tiny(path, *, layers=2, hidden=128, tie=False, seed=0):
    """A seeded random Llama (float32) saved as a HF directory with a small tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ray_train_tpu.rl.models import _tokenizer

    config = LlamaConfig(vocab_size=17, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return Path(path)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _exported(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _exported_file(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ---------------------------------------------------------------- 2 ranks: FSDP2 and TP checkpoints


def _trainer_worker(rank, world, tmp, base):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from ray_train_tpu.device import get_device
    from ray_train_tpu.strategies import FSDP2Strategy, TensorParallelStrategy

    tmp, device = Path(tmp), get_device()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fsdp = FSDP2Strategy(shard_modules=(LlamaDecoderLayer,))
    fsdp.setup(device, world_size=world, num_slices=1)
    model = fsdp.parallelize(_load(base), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 17, (2, 12), generator=torch.Generator().manual_seed(rank)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    checkpoint.save(tmp / "fsdp", model=model, optimizer=opt, step=1)
    sd = get_model_state_dict(model, options=full)
    if rank == 0:
        torch.save(sd, tmp / "fsdp_full.pt")
    info = export_hf(tmp / "fsdp", base, tmp / "fsdp_hf", max_file_bytes=FILE_BYTES)

    attn = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    mlp = {f"model.layers.*.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}
    tp = TensorParallelStrategy(plan={**attn, **mlp, "model.layers.*.self_attn.o_proj": RowwiseParallel(),
                                      "model.layers.*.mlp.down_proj": RowwiseParallel()})
    tp.setup(device, world_size=world, num_slices=1)
    model = tp.parallelize(_load(base), device)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    checkpoint.save(tmp / "tp", model=model, step=2)
    sd = get_model_state_dict(model, options=full)
    if rank == 0:
        torch.save(sd, tmp / "tp_full.pt")
    return {"export_world_size": info.export_world_size, "files": list(info.files), "step": info.step}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints written by FSDP2 and TP on 2 ranks; the FSDP2 one exported by those 2 ranks."""
    tmp = tmp_path_factory.mktemp("export")
    base = _tiny(tmp / "base")
    results = _spawn.run(_trainer_worker, 2, str(tmp), str(base), timeout_s=240, simulate_tpu=True)
    return tmp, base, results


def _assert_bitwise(exported: dict, full: dict, tied: bool):
    expected = {k: v for k, v in full.items() if not (tied and k == "lm_head.weight")}
    assert sorted(exported) == sorted(expected)
    for k, v in expected.items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k


def _assert_greedy_same(path, full: dict, base):
    prompts = torch.tensor([[1, 5, 14, 6, 16], [1, 9, 9, 15, 4]])
    in_memory = _load(base)
    in_memory.load_state_dict(full)
    loaded = _load(path)
    for k, v in in_memory.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompts))
    assert torch.equal(loaded.generate(prompts, **kw), in_memory.generate(prompts, **kw))


def test_fsdp2_checkpoint_exported_by_its_two_ranks_equals_the_full_state_dict(trained):
    tmp, base, results = trained
    assert [r["export_world_size"] for r in results] == [2, 2] and results[0]["step"] == 1
    files = results[0]["files"]
    assert len(files) >= 3 and files == results[1]["files"]
    full = torch.load(tmp / "fsdp_full.pt")
    assert not torch.equal(full["model.norm.weight"], _load(base).state_dict()["model.norm.weight"])  # trained
    _assert_bitwise(_exported(tmp / "fsdp_hf"), full, tied=False)
    index = json.loads((tmp / "fsdp_hf" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp / "fsdp_hf" / name).is_file(), name
    assert not list((tmp / "fsdp_hf").glob(".export-*"))  # staging removed
    _assert_greedy_same(tmp / "fsdp_hf", full, base)


def test_tp_checkpoint_exported_in_one_process_and_served_by_transformers(trained, tmp_path):
    tmp, base, _ = trained
    info = export_hf(tmp / "tp", base, tmp_path / "hf")
    assert (info.step, info.world_size, info.export_world_size, info.dtype) == (2, 2, 1, "float32")
    full = torch.load(tmp / "tp_full.pt")
    _assert_bitwise(_exported(tmp_path / "hf"), full, tied=False)
    _assert_greedy_same(tmp_path / "hf", full, base)


# ---------------------------------------------------------------- one process: refusals, URI, CLI


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tied-embedding model (the base stores no lm_head.weight), changed and saved in one process."""
    tmp = tmp_path_factory.mktemp("tied")
    base = _tiny(tmp / "base", tie=True, hidden=64)
    model = _load(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    checkpoint.save(tmp / "ckpt", model=model, step=7)
    return tmp, base, model.state_dict()


def test_tied_model_exports_without_the_tied_copy_and_loads_tied(tied, tmp_path):
    tmp, base, full = tied
    info = export_hf(str(tmp / "ckpt"), str(base), str(tmp_path / "out"), dtype="bfloat16")
    assert info.dtype == "bfloat16" and json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    exported = _exported(tmp_path / "out")
    _assert_bitwise(exported, {k: v.to(torch.bfloat16) for k, v in full.items()}, tied=True)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


def test_refuses_an_incomplete_or_truncated_checkpoint(tied, tmp_path):
    tmp, base, _ = tied
    broken = tmp_path / "ckpt"
    shutil.copytree(tmp / "ckpt", broken)
    shard = next(broken.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ExportError, match=r"cannot be exported: .*truncated"):
        export_hf(broken, base, tmp_path / "out")
    (broken / "manifest.json").unlink()
    with pytest.raises(ExportError, match=r"cannot be exported: .*manifest.json not found"):
        export_hf(broken, base, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written


def test_refuses_a_base_model_with_other_names_or_shapes(tied, tmp_path):
    tmp, _, _ = tied
    with pytest.raises(ExportError, match=r"is not of the base model .*'model.layers.2.mlp.down_proj.weight' is in "
                                          r"the base model but not in the checkpoint"):
        export_hf(tmp / "ckpt", _tiny(tmp_path / "deeper", layers=3, hidden=64, tie=True), tmp_path / "out")
    with pytest.raises(ExportError, match=r"'model.embed_tokens.weight' is \[17, 64\] in the checkpoint and "
                                          r"\[17, 128\] in the base model"):
        export_hf(tmp / "ckpt", _tiny(tmp_path / "wider", hidden=128, tie=True), tmp_path / "out")
    # The same names, but a config that does not tie: the checkpoint's lm_head.weight has no place.
    untied = tmp_path / "untied"
    shutil.copytree(tmp / "base", untied)
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    with pytest.raises(ExportError, match=r"'lm_head.weight' is in the checkpoint but not in the base model"):
        export_hf(tmp / "ckpt", untied, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_destination_unless_overwrite(tied, tmp_path):
    tmp, base, full = tied
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("x")
    with pytest.raises(ExportError, match=r"not empty \(1 entries, e.g. 'old.txt'\): pass overwrite=True"):
        export_hf(tmp / "ckpt", base, dest)
    info = export_hf(tmp / "ckpt", base, dest, overwrite=True)
    assert not (dest / "old.txt").exists() and info.num_tensors == len(full) - 1
    with pytest.raises(ExportError, match=r"holds .*ckpt: export into a directory of its own"):
        export_hf(tmp / "ckpt", base, tmp, overwrite=True)
    assert (tmp / "ckpt" / "manifest.json").is_file()


def test_uri_destination_through_a_pyarrow_filesystem(tied, tmp_path):
    import fsspec
    import pyarrow.fs

    tmp, base, full = tied
    memory = fsspec.filesystem("memory")
    fs = pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(memory))
    info = export_hf(tmp / "ckpt", base, "/bucket/model", filesystem=fs, max_file_bytes=20_000)
    local = export_hf(tmp / "ckpt", base, tmp_path / "local", max_file_bytes=20_000)
    assert info.files == local.files and len(info.files) > 1
    from safetensors.torch import load

    for name in info.files:  # the same tensors (a header's metadata is a hash map: its order varies)
        _assert_bitwise(load(memory.cat_file(f"/bucket/model/{name}")), _exported_file(tmp_path / "local" / name),
                        tied=False)
    for name in ("model.safetensors.index.json", "config.json", "tokenizer.json"):
        assert memory.cat_file(f"/bucket/model/{name}") == (tmp_path / "local" / name).read_bytes(), name
    with pytest.raises(ExportError, match="not empty"):
        export_hf(tmp / "ckpt", base, "/bucket/model", filesystem=fs)
    export_hf(tmp / "ckpt", base, f"file://{tmp_path / 'as_uri'}")
    assert (tmp_path / "as_uri" / "config.json").is_file()


def test_cli_exports_and_refuses_in_one_line(tied, tmp_path, capsys):
    from ray_train_tpu.cli import main

    tmp, base, _ = tied
    argv = ["export", str(tmp / "ckpt"), "--base-model", str(base), "--dest", str(tmp_path / "out")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "exported step 7" in out and str(tmp_path / "out") in out
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_train_tpu: error: destination") and "--overwrite" in err and len(err.splitlines()) == 1
    assert main([*argv, "--overwrite", "--dtype", "bfloat16"]) == 0
    assert main([*argv, "--overwrite", "--max-file-mib", "0"]) == 2
    assert "--max-file-mib: '0' is not a whole number of MiB" in capsys.readouterr().err


def test_hf_names_drops_one_prefix_and_tied_copies_only():
    base = {"model.embed.weight": (4, 2), "model.norm.weight": (2,)}
    ours = {"lm.model.embed.weight": (4, 2), "lm.model.norm.weight": (2,), "lm.lm_head.weight": (4, 2)}
    assert hf_names(ours, base, tied=True) == {"lm.model.embed.weight": "model.embed.weight",
                                               "lm.model.norm.weight": "model.norm.weight"}
    assert hf_names({"_orig_mod.model.norm.weight": (2,), "model.embed.weight": (4, 2)}, base, tied=False) == {
        "_orig_mod.model.norm.weight": "model.norm.weight", "model.embed.weight": "model.embed.weight"}
    with pytest.raises(ValueError, match=r"'lm.lm_head.weight' is in the checkpoint but not in the base model"):
        hf_names(ours, base, tied=False)
    with pytest.raises(ValueError, match=r"'lm.value_head.weight' is in the checkpoint"):
        hf_names({**ours, "lm.value_head.weight": (1, 2)}, base, tied=True)
