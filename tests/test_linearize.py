"""`rnnserve linearize`: a softmax model becomes a linear one of the same shape, every weight kept, a learned
feature map added, then fine-tuned by training's own machinery (warm start, teacher, lineage, checkpoints)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from model.config import ModelConfig
from model.transformer import build_model
from model.io.weights import load_model, read_metadata, save_model
from rnnserve_cli import main
from training.errors import TrainError
from training.train import uses_autocast
from training.warm_start import init_from

from conftest import make_tiny_config, sharpen_

CPU = torch.device("cpu")


@pytest.fixture
def softmax_file(tmp_path: Path) -> Path:
    path = tmp_path / "softmax.safetensors"
    save_model(sharpen_(build_model(make_tiny_config("softmax", max_len=16)), seed=4), path)
    return path


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")
    return path


@dataclass
class Transfer:
    """What an attention-transfer test starts from: the softmax teacher, students warm-started from it, and
    batches of the corpus drawn with one seeded generator."""

    teacher: torch.nn.Module
    student: Callable[..., torch.nn.Module]  # the teacher's config with these changes, the teacher's weights kept
    batch: Callable[[], torch.Tensor]  # (8, 16) token windows
    gen: torch.Generator


@pytest.fixture
def transfer_setup(softmax_file: Path, corpus: Path) -> Transfer:
    from training.data import load_text

    teacher, _ = load_model(softmax_file)
    data = load_text(corpus).train
    gen = torch.Generator().manual_seed(0)

    def student(**changes) -> torch.nn.Module:
        model = build_model(teacher.config.replace(**changes))
        init_from(str(softmax_file), model)
        return model

    def batch() -> torch.Tensor:
        starts = torch.randint(0, data.shape[0] - 16, (8,), generator=gen)
        return data[starts[:, None] + torch.arange(16)].long()  # (8, 16)

    return Transfer(teacher, student, batch, gen)


def linearize(tmp_path: Path, source: Path, corpus: Path, *extra: str) -> int:
    return main(
        [
            "linearize",
            str(source),
            "--data",
            str(corpus),
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--no-progress",
            "--no-eval",
            "--save-dtype",
            "float32",
            "--checkpoint",
            str(tmp_path / "lin.ckpt"),
            *extra,
        ]
    )


@pytest.mark.parametrize("feature_map", ["hedgehog", "t2r", "elu"])
def test_the_linear_model_keeps_every_softmax_weight_and_adds_the_map(tmp_path, softmax_file, corpus, feature_map):
    out = tmp_path / f"{feature_map}.safetensors"
    # lr 1e-12: the fine-tuning steps move nothing visible, so what the file holds is what linearize made
    assert (
        linearize(tmp_path, softmax_file, corpus, "--out", str(out), "--feature-map", feature_map, "--lr", "1e-12") == 0
    )
    softmax, _ = load_model(softmax_file)
    linear, info = load_model(out)
    assert linear.config.attention == "linear" and linear.config.linear_feature_map == feature_map
    shape = ("n_layers", "d_model", "n_heads", "d_ff", "max_len", "task")
    assert [getattr(linear.config, f) for f in shape] == [getattr(softmax.config, f) for f in shape]
    kept = dict(softmax.named_parameters())
    added = {name for name, _ in linear.named_parameters() if name not in kept}
    assert added == (
        {f"blocks.{i}.attn.feature_map.{p}" for i in range(2) for p in ("weight", "bias")}
        if feature_map != "elu"
        else set()
    )
    for name, value in linear.named_parameters():
        if name in kept:
            torch.testing.assert_close(value, kept[name], atol=1e-6, rtol=0)
    assert info["init_from"] == str(softmax_file)
    assert [t["file"] for t in info["distillation"]["teachers"]] == [softmax_file.name]
    assert info["command"].startswith("rnnserve linearize ")


TINY = [
    "--context",
    "16",
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--d-ff",
    "64",
    "--warmup-steps",
    "1",
    "--device",
    "cpu",
    "--threads",
    "1",
    "--no-progress",
    "--no-eval",
]


def test_fine_tuning_from_the_softmax_weights_beats_starting_from_scratch(tmp_path, corpus):
    trained = tmp_path / "trained-softmax.safetensors"
    assert (
        main(
            [
                "train",
                "--task",
                "text",
                "--attention",
                "softmax",
                "--data",
                str(corpus),
                *TINY,
                "--steps",
                "40",
                "--save-dtype",
                "float32",
                "--checkpoint",
                str(tmp_path / "softmax.ckpt"),
                "--out",
                str(trained),
            ]
        )
        == 0
    )
    warm, cold = tmp_path / "warm.safetensors", tmp_path / "cold.safetensors"
    assert linearize(tmp_path, trained, corpus, "--out", str(warm), "--no-teacher") == 0
    _, warm_info = load_model(warm)
    assert warm_info.get("distillation") is None  # --no-teacher: the data alone
    scratch = [
        "train",
        "--task",
        "text",
        "--attention",
        "linear",
        "--linear-feature-map",
        "hedgehog",
        "--data",
        str(corpus),
        *TINY,
        "--steps",
        "2",
        "--checkpoint",
        str(tmp_path / "cold.ckpt"),
        "--out",
        str(cold),
    ]
    assert main(scratch) == 0
    _, cold_info = load_model(cold)
    assert warm_info["final_train_loss_nats"] < cold_info["final_train_loss_nats"]


def test_a_model_that_is_not_softmax_is_refused_in_one_line(tmp_path, corpus, capsys):
    path = tmp_path / "linear.safetensors"
    save_model(build_model(make_tiny_config("linear", max_len=16)), path)
    assert linearize(tmp_path, path, corpus, "--out", str(tmp_path / "x.safetensors")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line == f"rnnserve linearize: error: {path} is a linear model; linearize turns a softmax model into a "
        "linear or hybrid one"
    )
    assert linearize(tmp_path, tmp_path / "none.safetensors", corpus, "--out", str(tmp_path / "x.safetensors")) == 2
    assert "rnnserve linearize: error: " in capsys.readouterr().err


def test_out_into_a_folder_not_made_yet_is_made_as_import_makes_it(tmp_path, softmax_file, corpus):
    out = tmp_path / "not" / "yet" / "linear.safetensors"
    assert linearize(tmp_path, softmax_file, corpus, "--out", str(out), "--feature-map", "elu") == 0
    assert load_model(out)[0].config.attention == "linear"


def test_a_mistral_s_sliding_window_is_refused_in_one_line_naming_it(tmp_path, corpus, capsys):
    """Linear attention implements a Llama's rotary positions and grouped-query attention, not a sliding window."""
    path = tmp_path / "mistral.safetensors"
    save_model(build_model(make_tiny_config("softmax+mistral", max_len=16)), path)
    assert linearize(tmp_path, path, corpus, "--out", str(tmp_path / "x.safetensors")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rnnserve linearize: error: ") and "sliding_window 10" in line, line
    assert not (tmp_path / "x.safetensors").exists()


def test_a_warm_start_may_not_drop_parameters_of_another_kind(tmp_path):
    source = tmp_path / "hedgehog.safetensors"
    save_model(build_model(make_tiny_config("linear+hedgehog", max_len=16)), source)
    softmax = build_model(make_tiny_config("softmax", max_len=16))
    with pytest.raises(
        TrainError,
        match=r"the file's linear parameter blocks\.0\.attn\.feature_map\.weight has no place "
        r"of its shape in a softmax model \(4 such\)",
    ):
        init_from(str(source), softmax)


def test_the_new_options_keep_older_files_loading_as_they_were():
    old = json.loads(ModelConfig(attention="linear").to_json())
    for key in ("linear_feature_map", "linear_features"):
        del old[key]  # a file written before the learned maps
    config = ModelConfig.from_dict(old)
    assert (config.linear_feature_map, config.linear_features) == ("elu", 0)


def test_attention_transfer_teaches_the_maps_softmax_s_weights(transfer_setup):
    from training.attention_transfer import teacher_queries_keys, transfer, transfer_loss

    teacher, batch, gen = transfer_setup.teacher, transfer_setup.batch, transfer_setup.gen
    student = transfer_setup.student(attention="linear", linear_feature_map="hedgehog")
    probe = batch()
    rows = torch.arange(16)

    pairs = teacher_queries_keys(teacher, probe)
    entropy = 0.0  # of the teacher's own weights: the cross-entropy's floor
    for q, k in pairs:
        logits = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~torch.ones(16, 16).tril().bool(), -1e9)
        weights = torch.softmax(logits, -1)
        entropy += float(-(weights * torch.log(weights + 1e-12)).sum(-1).mean()) / len(pairs)

    def divergence_now() -> float:  # KL(teacher || student), averaged over layers, heads and rows
        with torch.no_grad():
            return float(transfer_loss(student, pairs, rows)) - entropy

    frozen = {n: p.clone() for n, p in student.named_parameters() if "feature_map" not in n}
    before = divergence_now()
    transfer(student, teacher, batch, 60, 1e-2, gen, log=lambda line: None, loss="weight-ce")
    assert divergence_now() < 0.5 * before
    for name, value in student.named_parameters():  # only the maps learned
        if name in frozen:
            assert torch.equal(value, frozen[name]), name


def test_linearize_with_a_first_stage_fine_tunes_from_it_and_a_rerun_reuses_it(tmp_path, softmax_file, corpus, capsys):
    out = tmp_path / "staged.safetensors"
    flags = ["--out", str(out), "--feature-map", "hedgehog", "--transfer-steps", "3"]
    assert linearize(tmp_path, softmax_file, corpus, *flags) == 0
    first = tmp_path / "lin.transfer.safetensors"
    _, stage = read_metadata(first)
    assert stage["attention_transfer"]["steps"] == 3 and len(stage["lineage"]) == 1  # the softmax model's run
    assert stage["attention_transfer"]["autocast_bf16"] == uses_autocast(CPU, "auto")  # linearize's default
    _, info = read_metadata(out)
    assert info["init_from"] == str(first) and len(info["lineage"]) == 2
    assert info["lineage"][-1]["examples_seen"] == stage["examples_seen"] == 3 * 16
    assert [t["file"] for t in info["distillation"]["teachers"]] == [softmax_file.name]
    capsys.readouterr()
    assert linearize(tmp_path, softmax_file, corpus, *flags) == 0
    assert f"first stage: {first} exists" in capsys.readouterr().err


def test_a_first_stage_needs_a_learned_map(tmp_path, softmax_file, corpus, capsys):
    out = tmp_path / "elu.safetensors"
    assert (
        linearize(tmp_path, softmax_file, corpus, "--out", str(out), "--feature-map", "elu", "--transfer-steps", "2")
        == 2
    )
    assert "elu has none" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("autocast", ["off", "bf16"])
def test_output_transfer_teaches_a_hybrid_s_maps_and_mix_to_stand_in_for_softmax(transfer_setup, autocast):
    """Under bfloat16 autocast too, as linearize runs it where the CPU has bf16 (the error measured in float32)."""
    from training.attention_transfer import output_step, transfer
    from training.train import autocast_context

    teacher, batch, gen = transfer_setup.teacher, transfer_setup.batch, transfer_setup.gen
    student = transfer_setup.student(attention="hybrid", hybrid_window=4, hybrid_feature_map="hedgehog")
    probe = batch()

    def error_now() -> float:  # the layers' mean relative output error on a fixed batch, no step taken
        value = output_step(student, probe, teacher)
        student.zero_grad(set_to_none=True)
        return value

    frozen = {n: p.clone() for n, p in student.named_parameters() if "feature_map" not in n and ".mix" not in n}
    mixes = [block.attn.mix.clone() for block in student.blocks]
    before = error_now()
    transfer(student, teacher, batch, 60, 1e-2, gen, lambda line: None, autocast=autocast_context(CPU, autocast))
    assert error_now() < 0.5 * before
    assert any(not torch.equal(block.attn.mix, mix) for block, mix in zip(student.blocks, mixes))
    for name, value in student.named_parameters():  # the projections and everything else stayed the teacher's
        if name in frozen:
            assert torch.equal(value, frozen[name]), name


def test_linearize_into_a_hybrid_with_lora_trains_low_rank_corrections_only(tmp_path, softmax_file, corpus):
    out = tmp_path / "hybrid.safetensors"
    flags = ["--out", str(out), "--kind", "hybrid", "--window", "4", "--transfer-steps", "2", "--lora-rank", "2"]
    assert linearize(tmp_path, softmax_file, corpus, *flags, "--lr", "1e-2") == 0
    softmax, _ = load_model(softmax_file)
    hybrid, info = load_model(out)
    assert hybrid.config.attention == "hybrid" and hybrid.config.hybrid_window == 4
    assert hybrid.config.hybrid_feature_map == "hedgehog"
    teacher = dict(softmax.named_parameters())
    names = {name for name, _ in hybrid.named_parameters()}
    assert not [n for n in names if "parametrizations" in n or "lora" in n]  # adapters merged into the weights
    moved = 0
    for name, value in hybrid.named_parameters():
        if name not in teacher:
            continue
        change = value.detach() - teacher[name].detach()
        if name.endswith(("attn.qkv.weight", "attn.proj.weight")):
            assert torch.linalg.matrix_rank(change) <= 2, name  # W + B A with rank-2 B A
            moved += int(change.abs().max() > 0)
        else:
            assert torch.equal(change, torch.zeros_like(change)), name  # frozen
    assert moved == 2 * softmax.config.n_layers
    _, stage = read_metadata(tmp_path / "lin.transfer.safetensors")
    assert stage["attention_transfer"]["loss"] == "output-mse"


def test_a_lora_run_resumes_and_its_checkpoint_evaluates_as_merged(tmp_path, softmax_file, corpus):
    from training.loading import load_evaluated

    out = tmp_path / "hybrid.safetensors"
    flags = ["--out", str(out), "--kind", "hybrid", "--window", "4", "--lora-rank", "2", "--lr", "1e-2"]
    assert linearize(tmp_path, softmax_file, corpus, *flags, "--checkpoint-every", "1") == 0
    ckpt = tmp_path / "lin.ckpt"
    merged, _ = load_evaluated(ckpt, torch.device("cpu"))
    saved, _ = load_model(out)
    expected = dict(saved.named_parameters())
    assert {name for name, _ in merged.named_parameters()} == expected.keys()
    for name, value in merged.named_parameters():
        assert torch.allclose(value, expected[name], atol=1e-6), name
    # the same run continued two steps further from its checkpoint
    assert linearize(tmp_path, softmax_file, corpus, *flags, "--resume", "--extend", "--steps", "4") == 0
    assert read_metadata(out)[1]["steps"] == 4


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--lora-alpha", "8"], "--lora-alpha scales the adapters: add --lora-rank R"),
        (["--lora-rank", "-1"], "--lora-rank must be 0"),
        (["--window", "8"], "--window sizes a hybrid's softmax window: add --kind hybrid"),
        (["--kind", "hybrid", "--window", "0"], "--window must be at least 1"),
        (["--kind", "hybrid", "--transfer-steps", "1", "--transfer-loss", "weight-ce"], "output-mse"),
    ],
)
def test_linearize_flags_that_do_not_fit_are_refused_naming_them(tmp_path, softmax_file, corpus, capsys, flags, said):
    out = tmp_path / "refused.safetensors"
    assert linearize(tmp_path, softmax_file, corpus, "--out", str(out), *flags) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_weight_ce_reads_a_grouped_query_teacher_s_real_queries_and_keys():
    """A Llama's grouped-query teacher (a key head per two query heads, rotary positions) gives the same weights
    as the multi-head teacher that repeats each key head for its group: what softmax attention attends with."""
    from training.attention_transfer import teacher_queries_keys

    grouped = sharpen_(build_model(make_tiny_config("softmax+llama", max_len=16)), seed=5).eval()
    repeated = build_model(grouped.config.replace(kv_heads=0)).eval()  # as many key heads as query heads
    state = grouped.state_dict()
    h, kv, d = grouped.config.n_heads, grouped.config.n_kv_heads, grouped.config.d_head
    for i in range(grouped.config.n_layers):
        q, k, v = state[f"blocks.{i}.attn.qkv.weight"].split([h * d, kv * d, kv * d])
        k, v = (t.unflatten(0, (kv, d)).repeat_interleave(h // kv, dim=0).flatten(0, 1) for t in (k, v))
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, k, v])
    repeated.load_state_dict(state)
    tokens = torch.randint(0, grouped.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(grouped.token_log_probs(tokens), repeated.token_log_probs(tokens), atol=1e-5)
    for (q_g, k_g), (q_r, k_r) in zip(teacher_queries_keys(grouped, tokens), teacher_queries_keys(repeated, tokens)):
        assert q_g.shape == k_g.shape == (2, h, 16, d)
        assert torch.allclose(q_g, q_r, atol=1e-5) and torch.allclose(k_g, k_r, atol=1e-5)


def test_a_first_stage_passes_the_source_s_chat_template_on_to_the_final_model(tmp_path, corpus):
    from model.io.chat_template import ChatTemplate
    from model.io.weights import read_chat_template

    source = tmp_path / "chat.safetensors"
    template = ChatTemplate("{% for m in messages %}{{ m.content }}\n{% endfor %}", None, None).to_json()
    save_model(build_model(make_tiny_config("softmax", max_len=16)), source, chat_template=template)
    out = tmp_path / "chat-hybrid.safetensors"
    flags = ["--out", str(out), "--kind", "hybrid", "--window", "4", "--feature-map", "t2r", "--transfer-steps", "1"]
    assert linearize(tmp_path, source, corpus, *flags) == 0
    assert read_chat_template(tmp_path / "lin.transfer.safetensors") == template
    assert read_chat_template(out) == template
