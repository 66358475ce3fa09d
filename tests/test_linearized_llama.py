"""A Llama linearized: a tiny random `LlamaForCausalLM` (grouped-query attention, Llama 3's rope scaling, an untied
head) written by `transformers`' `save_pretrained`, imported with `rnnserve import hf`, and its linear and hybrid
twins built on its weights (a warm start copies them by name) or made by `rnnserve linearize`. Each is served over
real HTTP and its greedy text is what its parallel form computes from the prompt's tokens, one whole pass per
token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)
openai = pytest.importorskip("openai", reason="the OpenAI client (make test installs it)")

from hf_support import CORPUS  # noqa: E402
from server_support import make_settings, running_server  # noqa: E402
from test_hf_llama import imported, save_folder  # noqa: E402

from model.transformer import Transformer, build_model  # noqa: E402
from model.io.weights import load_model, read_chat_template, read_metadata, read_tokenizer, save_model  # noqa: E402
from rnnserve_cli import main  # noqa: E402
from training.warm_start import init_from  # noqa: E402

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """The imported softmax Llama, alone in a folder the server reads (the Hugging Face folder beside it)."""
    return imported(save_folder(tmp_path_factory.mktemp("served") / "llama", "llama"))


def twin(llama: Path, kind: str) -> Path:
    """`llama`'s twin of `kind` with a hedgehog map, every softmax weight kept, saved beside it."""
    softmax, _ = load_model(llama)
    window = {"hybrid_window": 8} if kind == "hybrid" else {}  # shorter than the prompt: the sums take keys
    config = softmax.config.replace(attention=kind, **window, **{f"{kind}_feature_map": "hedgehog"})
    model = build_model(config)
    init_from(str(llama), model)
    out = llama.with_name(f"llama-{kind}.safetensors")
    save_model(model, out, tokenizer=read_tokenizer(llama), chat_template=read_chat_template(llama))
    return out


def parallel_greedy(model: Transformer, ids: list[int], count: int) -> list[int]:
    """Greedy tokens, each the argmax of a whole pass from position 0 over the prompt and the tokens so far."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(count):
            logits, _ = model(torch.tensor([tokens]))
            token = int(logits[0, -1].argmax())
            if token == model.config.eos_token:
                break
            tokens.append(token)
    return tokens[len(ids) :]


def assert_served_greedy_text_is_the_parallel_form_s(weights: Path, files: list[Path]) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(weights / "llama")
    prompt = CORPUS[2]
    ids = tokenizer(prompt).input_ids
    with running_server(make_settings(weights=weights, max_batch=4)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        served = {model.id for model in client.models.list()}
        for path in files:
            assert path.stem in served
            answer = client.completions.create(model=path.stem, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            expected = parallel_greedy(load_model(path)[0].eval(), ids, NEW_TOKENS)
            assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(expected)
            assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), path.stem


def test_linear_and_hybrid_twins_keep_the_llama_s_weights_and_serve_their_parallel_form(llama):
    softmax, _ = load_model(llama)
    twins = [twin(llama, kind) for kind in ("linear", "hybrid")]
    for path in twins:
        model, _ = load_model(path)
        assert (model.config.n_kv_heads, model.config.pos_encoding) == (2, "rotary")
        mine = dict(model.named_parameters())
        assert all(torch.equal(p, mine[name]) for name, p in softmax.named_parameters())
        # their state is per key head: half the query heads here
        assert (
            model.state_bytes_per_sequence() * 2
            == build_model(model.config.replace(kv_heads=0)).state_bytes_per_sequence()
        )
    assert_served_greedy_text_is_the_parallel_form_s(llama.parent, [llama, *twins])


def test_linearize_turns_an_imported_llama_into_a_linear_model_that_serves(llama, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    out = llama.with_name("llama-linearized.safetensors")
    flags = ["--feature-map", "hedgehog", "--data", str(corpus), "--steps", "2", "--batch-size", "2"]
    run = ["--device", "cpu", "--threads", "1", "--no-progress", "--no-eval", "--checkpoint", str(tmp_path / "c.ckpt")]
    assert main(["linearize", str(llama), "--out", str(out), *flags, *run]) == 0
    softmax, _ = load_model(llama)
    linear, _ = load_model(out)
    assert linear.config.attention == "linear" and linear.config.linear_feature_map == "hedgehog"
    block = ("n_kv_heads", "pos_encoding", "rope_scaling", "norm", "feed_forward", "qkv_bias", "vocab_size")
    assert [getattr(linear.config, f) for f in block] == [getattr(softmax.config, f) for f in block]
    assert read_tokenizer(out) == read_tokenizer(llama)
    trained = dict(linear.named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in softmax.named_parameters())  # fine-tuned from them
    assert_served_greedy_text_is_the_parallel_form_s(llama.parent, [out])


def test_linearize_turns_an_imported_llama_into_a_hybrid_in_two_stages_that_serves(llama, tmp_path):
    """LoLCATs' two stages on an imported model (grouped-query attention, rotary positions): attention transfer,
    then LoRA on q/k/v/o merged into the weights; the file serves with constant-size state."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    out = llama.with_name("llama-hybrid-lora.safetensors")
    stages = ["--kind", "hybrid", "--window", "8", "--transfer-steps", "2", "--lora-rank", "2", "--lr", "1e-2"]
    flags = ["--data", str(corpus), "--steps", "2", "--batch-size", "2"]
    run = ["--device", "cpu", "--threads", "1", "--no-progress", "--no-eval", "--checkpoint", str(tmp_path / "h.ckpt")]
    run += ["--save-dtype", "float32"]  # as imported: frozen weights compare exactly
    assert main(["linearize", str(llama), "--out", str(out), *stages, *flags, *run]) == 0
    softmax, _ = load_model(llama)
    hybrid, info = load_model(out)
    assert (hybrid.config.attention, hybrid.config.hybrid_window) == ("hybrid", 8)
    assert hybrid.config.n_kv_heads == softmax.config.n_kv_heads < softmax.config.n_heads
    assert not [name for name, _ in hybrid.named_parameters() if "parametrizations" in name]  # adapters merged
    frozen = [n for n, _ in softmax.named_parameters() if not n.endswith(("attn.qkv.weight", "attn.proj.weight"))]
    trained = dict(hybrid.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in softmax.named_parameters() if n in frozen)
    changes = [trained[n] - p for n, p in softmax.named_parameters() if n not in frozen]  # q/k/v and o per layer
    assert len(changes) == 2 * softmax.config.n_layers and any(c.abs().max() > 0 for c in changes)
    for change in changes:  # W + B A, rank 2 up to float32's rounding of the sum
        singular = torch.linalg.svdvals(change.detach())
        assert int((singular > 1e-3 * singular[0]).sum()) <= 2
    _, stage = read_metadata(tmp_path / "h.transfer.safetensors")
    assert stage["attention_transfer"]["steps"] == 2 and info["init_from"] == str(tmp_path / "h.transfer.safetensors")
    assert read_tokenizer(out) == read_tokenizer(llama)
    assert_served_greedy_text_is_the_parallel_form_s(llama.parent, [out])
