"""`rnnserve train --teacher`: the teachers' mixture, the loss, resumes, and bad teachers.

Tiny text models on a generated corpus; teachers are real files written by `rnnserve train`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model.config import ModelConfig
from model.io.weights import load_model, read_metadata, save_model, update_info
from rnnserve_cli import parse_args
from training import train
from training.checkpoint import read_checkpoint
from training.run_state import RunSettings
from training.data import load_text
from training.distillation import accept_file_digests, check_teacher, file_digest, load_distillation, weights_digest


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat. the dog sat on the log. " * 40, encoding="utf-8")
    return path


def train_args(tmp_path: Path, corpus: Path, out: str, *extra: str) -> argparse.Namespace:
    return parse_args(
        [
            "train",
            "--task",
            "text",
            "--attention",
            "linear",
            "--data",
            str(corpus),
            "--preset",
            "tiny",
            "--context",
            "16",
            "--warmup-steps",
            "5",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--no-progress",
            "--no-eval",
            "--save-dtype",
            "float32",
            "--out",
            str(tmp_path / out),
            *extra,
        ]
    )


@pytest.fixture
def teachers(tmp_path: Path, corpus: Path) -> list[Path]:
    """Two trained tiny models that differ (seeds and steps), written as real files."""
    paths = []
    for seed, steps in ((1, 60), (2, 40)):
        name = f"teacher{seed}.safetensors"
        train.train(train_args(tmp_path, corpus, name, "--steps", str(steps), "--seed", str(seed), "--lr", "3e-3"))
        paths.append(tmp_path / name)
    return paths


def batch(corpus: Path) -> torch.Tensor:
    return load_text(corpus).train[: 8 * 16].view(8, 16).long()  # (8, 16)


def test_the_teacher_is_the_average_of_its_members_distributions(teachers: list[Path], corpus: Path) -> None:
    tokens = batch(corpus)
    student = load_model(teachers[0])[0].config
    distillation = load_distillation([str(p) for p in teachers], 0.5, student, torch.device("cpu"))
    members = [load_model(p)[0].eval() for p in teachers]
    with torch.no_grad():
        expected = torch.stack([m.next_token_log_probs(tokens).exp() for m in members]).mean(0)  # (8, 16, 256)
    got = distillation.probs(tokens)
    assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(8, 16), atol=1e-5)
    assert not torch.allclose(expected, members[0].next_token_log_probs(tokens).exp(), atol=1e-3)  # they differ


def test_teacher_shares_weigh_the_mixture(teachers: list[Path], corpus: Path) -> None:
    tokens = batch(corpus)
    student = load_model(teachers[0])[0].config
    members = [load_model(p)[0].eval() for p in teachers]
    with torch.no_grad():
        first, second = (m.next_token_log_probs(tokens).exp() for m in members)
    leaning = load_distillation([str(p) for p in teachers], 0.5, student, torch.device("cpu"), shares=[3.0, 1.0])
    assert leaning.shares == (0.75, 0.25)
    assert torch.allclose(leaning.probs(tokens), 0.75 * first + 0.25 * second, atol=1e-6)
    equal = load_distillation([str(p) for p in teachers], 0.5, student, torch.device("cpu"))
    assert equal.shares == (0.5, 0.5) and not torch.allclose(equal.probs(tokens), leaning.probs(tokens), atol=1e-3)


def test_a_resume_refuses_other_teacher_shares(tmp_path: Path, corpus: Path, teachers: list[Path]) -> None:
    common = [
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--checkpoint",
        str(tmp_path / "s.ckpt"),
        "--resume",
        "--teacher",
        str(teachers[0]),
        "--teacher",
        str(teachers[1]),
    ]
    train.train(train_args(tmp_path, corpus, "s.safetensors", *common, "--teacher-shares", "1", "3"), stop_after=2)
    assert read_checkpoint(tmp_path / "s.ckpt").run.teacher_shares == (0.25, 0.75)
    with pytest.raises(
        train.TrainError,
        match=r"s\.ckpt: this run differs from the checkpoint's \(teacher_shares "
        r"\(0\.25, 0\.75\) -> \(0\.75, 0\.25\)",
    ):
        train.train(train_args(tmp_path, corpus, "s.safetensors", *common, "--teacher-shares", "3", "1"))
    info = train.train(train_args(tmp_path, corpus, "s.safetensors", *common, "--teacher-shares", "2", "6"))
    assert [t["share"] for t in info["distillation"]["teachers"]] == [0.25, 0.75]  # the same shares, resumed


def test_the_loss_weighs_the_data_and_the_teachers(teachers: list[Path], corpus: Path) -> None:
    tokens = batch(corpus)
    student_file = teachers[1]
    student = load_model(student_file)[0]
    distillation = load_distillation([str(teachers[0])], 0.25, student.config, torch.device("cpu"))
    with torch.no_grad():
        loss, data = distillation.loss(student, tokens)
        log_probs = student.next_token_log_probs(tokens)
        target = load_model(teachers[0])[0].eval().next_token_log_probs(tokens).exp()
    expected_data = -log_probs.gather(-1, tokens[..., None]).mean()
    expected_soft = -(target * log_probs).sum(-1).mean()
    assert torch.allclose(data, expected_data) and torch.allclose(loss, 0.75 * expected_data + 0.25 * expected_soft)
    assert abs(float(expected_soft - expected_data)) > 1e-3  # the two terms differ, so the weight matters


def kl_to(teacher: Path, student: Path, tokens: torch.Tensor) -> float:
    """Mean KL(teacher || student) over the batch's positions, nats."""
    with torch.no_grad():
        t = load_model(teacher)[0].eval().next_token_log_probs(tokens)
        s = load_model(student)[0].eval().next_token_log_probs(tokens)
    return float((t.exp() * (t - s)).sum(-1).mean())


def test_a_distilled_student_matches_its_teacher_better_than_one_trained_on_data(tmp_path: Path, corpus: Path) -> None:
    # A teacher that learned another text predicts this one differently from its data, so only a student that
    # learns from the teacher can come close to it.
    other = tmp_path / "other.txt"
    other.write_text("a bird flew over a green hill, singing. " * 40, encoding="utf-8")
    teacher = tmp_path / "teacher.safetensors"
    train.train(train_args(tmp_path, other, teacher.name, "--steps", "60", "--lr", "3e-3"))
    common = ["--steps", "40", "--seed", "5", "--lr", "3e-3"]
    train.train(train_args(tmp_path, corpus, "plain.safetensors", *common))
    info = train.train(
        train_args(tmp_path, corpus, "taught.safetensors", *common, "--teacher", str(teacher), "--distill-weight", "1")
    )
    tokens = batch(corpus)
    taught, plain = (
        kl_to(teacher, tmp_path / "taught.safetensors", tokens),
        kl_to(teacher, tmp_path / "plain.safetensors", tokens),
    )
    assert taught < 0.5 * plain, (taught, plain)
    stored = read_metadata(tmp_path / "taught.safetensors")[1]["distillation"]
    assert (
        stored
        == info["distillation"]
        == {
            "weight": 1.0,
            "teachers": [
                {
                    "file": teacher.name,
                    "sha256": file_digest(teacher),
                    "weights_sha256": weights_digest(teacher),
                    "share": 1.0,
                }
            ],
        }
    )
    assert read_metadata(tmp_path / "plain.safetensors")[1]["distillation"] is None


def test_a_distilled_run_resumes_bit_for_bit(tmp_path: Path, corpus: Path, teachers: list[Path]) -> None:
    common = [
        "--steps",
        "6",
        "--checkpoint-every",
        "3",
        "--checkpoint-precision",
        "float32",
        "--dropout",
        "0.1",
        "--teacher",
        str(teachers[0]),
        "--teacher",
        str(teachers[1]),
    ]
    train.train(train_args(tmp_path, corpus, "a.safetensors", *common, "--checkpoint", str(tmp_path / "a.ckpt")))
    resumed = train_args(
        tmp_path, corpus, "b.safetensors", *common, "--checkpoint", str(tmp_path / "b.ckpt"), "--resume"
    )
    train.train(resumed, stop_after=3)
    assert read_checkpoint(tmp_path / "b.ckpt").run.teacher_digests == tuple(weights_digest(p) for p in teachers)
    train.train(resumed)
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_refuses_a_teacher_that_changed(tmp_path: Path, corpus: Path, teachers: list[Path]) -> None:
    common = ["--steps", "4", "--checkpoint-every", "2", "--checkpoint", str(tmp_path / "c.ckpt"), "--resume"]
    run = train_args(tmp_path, corpus, "c.safetensors", *common, "--teacher", str(teachers[0]))
    train.train(run, stop_after=2)
    teachers[0].write_bytes(teachers[1].read_bytes())  # the same path, another model
    with pytest.raises(train.TrainError, match=r"c\.ckpt: this run differs from the checkpoint's \(teacher_digests"):
        train.train(run)
    with pytest.raises(train.TrainError, match=r"teacher_digests \('[0-9a-f]{64}',\) -> \(\)"):
        train.train(train_args(tmp_path, corpus, "c.safetensors", *common))  # the teacher left out


def test_a_teacher_is_named_by_its_weights_not_by_its_stored_info(
    tmp_path: Path, corpus: Path, teachers: list[Path]
) -> None:
    # `rnnserve eval --store` rewrites a file's info: a resume must still take it as the same teacher.
    common = [
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--checkpoint-precision",
        "float32",
        "--teacher",
        str(teachers[0]),
    ]
    train.train(train_args(tmp_path, corpus, "a.safetensors", *common, "--checkpoint", str(tmp_path / "a.ckpt")))
    before = (file_digest(teachers[0]), weights_digest(teachers[0]))
    resumed = train_args(
        tmp_path, corpus, "b.safetensors", *common, "--checkpoint", str(tmp_path / "b.ckpt"), "--resume"
    )
    train.train(resumed, stop_after=2)
    update_info(teachers[0], {"completions": {"accuracy": 0.5}})
    assert file_digest(teachers[0]) != before[0] and weights_digest(teachers[0]) == before[1]
    train.train(resumed)
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_weights_digest_stays_when_a_newer_rnnserve_gains_config_keys(teachers: list[Path], monkeypatch) -> None:
    """A teacher file is the same teacher after an upgrade that adds config keys (a kind's new option here), so a
    distilled run written before the upgrade resumes after it."""
    from model.attention.kinds import ATTENTION_KINDS, AttentionKind, KindOption

    before = weights_digest(teachers[0])
    linear = ATTENTION_KINDS["linear"]
    monkeypatch.setitem(
        ATTENTION_KINDS, "linear", AttentionKind(linear.cls, (*linear.options, KindOption("linear_new", 1, "new")))
    )
    assert '"linear_new": 1' in load_model(teachers[0])[0].config.to_json()  # the config reads differently now
    assert weights_digest(teachers[0]) == before


def test_the_weights_digest_changes_with_any_number(tmp_path: Path, teachers: list[Path]) -> None:
    model, info = load_model(teachers[0])
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0  # one number changed
    save_model(model, tmp_path / "changed.safetensors", info=info)
    assert weights_digest(tmp_path / "changed.safetensors") != weights_digest(teachers[0])
    assert weights_digest(teachers[0]) != weights_digest(teachers[1])


def test_an_older_checkpoint_naming_teachers_by_file_digest_is_read_as_naming_them_by_weights(
    teachers: list[Path],
) -> None:
    files = [str(p) for p in teachers]
    now = RunSettings(
        4, None, 8, 1e-3, 5, 0.0, 100, teacher_digests=tuple(map(weights_digest, files)), distill_weight=0.5
    )
    by_file = RunSettings(
        4, None, 8, 1e-3, 5, 0.0, 100, teacher_digests=tuple(map(file_digest, files)), distill_weight=0.5
    )
    assert accept_file_digests(by_file, now, files) == now
    swapped = RunSettings(
        4, None, 8, 1e-3, 5, 0.0, 100, teacher_digests=tuple(map(file_digest, files[::-1])), distill_weight=0.5
    )
    assert accept_file_digests(swapped, now, files) == swapped  # other files: still a difference to refuse


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distill-weight", "0.5"], r"--distill-weight weighs the teachers' targets: add --teacher FILE"),
        (["--teacher", "TEACHER", "--distill-weight", "0"], r"--distill-weight must be in \(0, 1\]"),
        (["--teacher-shares", "1"], r"--teacher-shares weighs the teachers in their mixture: add --teacher FILE"),
        (
            ["--teacher", "TEACHER", "--teacher-shares", "1", "2"],
            r"--teacher-shares has 2 shares for 1 --teacher files; expected one share per teacher",
        ),
        (
            ["--teacher", "TEACHER", "--teacher", "TEACHER", "--teacher-shares", "1", "0"],
            r"--teacher-shares must be positive numbers, got 1\.0 0\.0",
        ),
        (["--teacher", "MISSING"], r"--teacher .*none\.safetensors: no such file; expected a \.safetensors model"),
        (["--teacher", "JUNK"], r"--teacher: .*junk\.safetensors"),
        (
            ["--teacher", "SHORT"],
            r"--teacher .*short\.safetensors: it reads up to 8 tokens, this run trains on 16; "
            r"expected a teacher at least as long",
        ),
    ],
)
def test_bad_teachers_are_clear_errors(
    tmp_path: Path, corpus: Path, teachers: list[Path], flags: list[str], message: str
) -> None:
    (tmp_path / "junk.safetensors").write_bytes(b"not a model")
    train.train(train_args(tmp_path, corpus, "short.safetensors", "--steps", "1", "--context", "8"))
    names = {
        "TEACHER": teachers[0],
        "MISSING": tmp_path / "none.safetensors",
        "JUNK": tmp_path / "junk.safetensors",
        "SHORT": tmp_path / "short.safetensors",
    }
    argv = [str(names.get(flag, flag)) for flag in flags]
    with pytest.raises(train.TrainError, match=message):
        train.train(train_args(tmp_path, corpus, "s.safetensors", "--steps", "1", *argv))


def test_a_teacher_of_another_task_is_named(tmp_path: Path, corpus: Path, teachers: list[Path]) -> None:
    student = ModelConfig(attention="linear", task="mnist", n_layers=1, d_model=8, n_heads=2, d_ff=16, max_len=784)
    with pytest.raises(train.TrainError, match=r"a text model with 256 classes cannot teach this mnist model"):
        check_teacher(str(teachers[0]), load_model(teachers[0])[0].config, student)
