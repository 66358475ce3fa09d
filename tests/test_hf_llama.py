"""`rnnserve import hf` on the Llama family: tiny random `LlamaForCausalLM` (grouped-query attention, an untied
head, Llama 3's rope scaling), `Qwen2ForCausalLM` (q/k/v biases) and `MistralForCausalLM` (a sliding window),
written by Hugging Face's own `save_pretrained` in float32 and bfloat16, whole and sharded. Their logits, greedy
tokens and served text are `transformers`' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model.decode.compiled.decoder import CompiledDecoder
from model.decode.generate import generate
from model.decode.sampling import BatchSampling, SamplingParams
from model.io.weights import load_model
from model.kernels.loader import load_kernels, packed_linear_wins
from model.kernels.packed_linear import PackedLinear, PackedTiedHead, decode_twin
from rnnserve_cli import main

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face side of the comparison (make test installs it)"
)
openai = pytest.importorskip("openai", reason="the OpenAI client (make test installs it)")

from hf_support import CORPUS, byte_level_tokenizer  # noqa: E402
from server_support import make_settings, running_server  # noqa: E402

START, END = "<s>", "</s>"
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=420)
SIZES["max_position_embeddings"] = 96


def llama_tokenizer():
    """A byte-level BPE whose post-processor starts every text with <s>, as Llama 3's does."""
    from tokenizers import processors

    tokenizer = byte_level_tokenizer(400)
    tokenizer.add_special_tokens([START, END])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{START} $A", special_tokens=[(START, tokenizer.token_to_id(START))]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=START, eos_token=END)


def sentencepiece_tokenizer():
    """A SentencePiece-style BPE as Llama 2's and Mistral's tokenizer.json have it: spaces as '▁', <0xNN> tokens for
    the bytes of characters the vocabulary lacks, <s> before every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    base.train_from_iterator(CORPUS[:3], trainers.BpeTrainer(vocab_size=150, special_tokens=["<unk>", START, END]))
    spec = json.loads(base.to_str())["model"]
    vocab = dict(spec["vocab"])
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens(["<unk>", START, END])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{START} $A", special_tokens=[(START, tokenizer.token_to_id(START))]
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=START, eos_token=END)


FAMILIES = {
    "llama": lambda ids: transformers.LlamaConfig(
        **SIZES,
        **ids,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": lambda ids: transformers.Qwen2Config(**SIZES, **ids, num_key_value_heads=1, tie_word_embeddings=True),
    "mistral": lambda ids: transformers.MistralConfig(**SIZES, **ids, num_key_value_heads=2, sliding_window=8),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def save_folder(
    folder: Path, family: str, dtype: torch.dtype = torch.float32, shard: str | None = None, tokenizer=None
) -> Path:
    tokenizer = tokenizer or llama_tokenizer()
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = FAMILIES[family](ids)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(config).eval()
    with torch.no_grad():  # weights at a scale where every layer and bias matters to the logits
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.to(dtype).save_pretrained(folder, max_shard_size=shard) if shard else model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def imported(folder: Path) -> Path:
    out = folder.parent / f"{folder.name}.safetensors"
    assert main(["import", "hf", str(folder), "--out", str(out)]) == 0
    return out


def hf_model(folder: Path, dtype: torch.dtype = torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype, attn_implementation="eager")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_folder(request, tmp_path_factory) -> Path:
    return save_folder(tmp_path_factory.mktemp(request.param) / request.param, request.param)


@pytest.mark.parametrize("length", [40, 90])
def test_the_logits_are_hugging_face_s(family_folder, length):
    model, _ = load_model(imported(family_folder))
    ids = torch.randint(0, 400, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf_model(family_folder).eval()(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_64_greedy_tokens_are_hugging_face_s_and_decode_steps_equal_the_whole_pass(family_folder):
    model, _ = load_model(imported(family_folder))
    prompt = torch.tensor([[1, 17, 42, 99, 7]])
    greedy = BatchSampling.from_params([SamplingParams(temperature=0.0)])
    ours = generate(model, prompt, prompt.shape[1] + 64, greedy, compiled=False)
    hf = hf_model(family_folder)
    hf.generation_config.eos_token_id = None  # 64 tokens whatever they are, as `generate` here draws
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, do_sample=False)
    assert ours[0].tolist() == theirs[0].tolist()


def test_the_cache_keeps_only_the_key_and_value_heads(family_folder):
    model, _ = load_model(imported(family_folder))
    hf = json.loads((family_folder / "config.json").read_text())
    cache = model.new_state(1).layers[0]
    assert cache.k.shape == (1, hf["num_key_value_heads"], hf["max_position_embeddings"], 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_sharded_weights_are_kept_in_their_dtype(tmp_path, dtype):
    folder = save_folder(tmp_path / "llama16", "llama", dtype=dtype, shard="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    out = imported(folder)
    model, _ = load_model(out, dtype=dtype)
    assert model.tok_emb.weight.dtype == dtype
    ids = torch.randint(0, 400, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        wide, _ = load_model(out)[0](ids)  # the same weights widened to float32
        theirs = hf_model(folder, torch.float32).eval()(ids).logits
    assert (wide - theirs).abs().max() < 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'; expected silu"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
            "unsupported rope_scaling.rope_type 'yarn'",
        ),
        ({"head_dim": 32}, "unsupported head_dim 32"),
        ({"pretraining_tp": 2}, "unsupported pretraining_tp 2"),
    ],
)
def test_a_llama_value_computed_otherwise_is_refused_naming_it(tmp_path, capsys, change, message):
    folder = save_folder(tmp_path / "llama", "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["import", "hf", str(folder), "--out", str(tmp_path / "x" / "x.safetensors")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "x" / "x.safetensors").exists()


def test_a_served_llama_continues_text_as_hugging_face_does(tmp_path):
    folder = save_folder(tmp_path / "llama", "llama")
    imported(folder)
    tokenizer, model = transformers.AutoTokenizer.from_pretrained(folder), hf_model(folder)
    prompt = CORPUS[0]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id  # the tokenizer starts the text with <s>, not the server
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
    expected = expected[0, ids.shape[1] :]
    with running_server(make_settings(weights=tmp_path, max_batch=4)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model="llama", prompt=prompt, max_tokens=64, temperature=0)
    assert answer.usage.prompt_tokens == ids.shape[1] and answer.usage.completion_tokens == len(expected)
    assert answer.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_mistral_with_a_sentencepiece_tokenizer_continues_text_as_vllm_shows_it(tmp_path):
    tokenizer = sentencepiece_tokenizer()
    folder = save_folder(tmp_path / "mistral", "mistral", tokenizer=tokenizer)
    imported(folder)
    model = hf_model(folder)
    prompt = "Grüße, 世界! To be"  # characters the vocabulary lacks take byte-fallback tokens
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0, 0] == tokenizer.bos_token_id and any(
        t.startswith("<0x") for t in tokenizer.convert_ids_to_tokens(ids[0])
    )
    model.generation_config.eos_token_id = None
    # Drawn text stays whole characters: a random model's stray byte tokens make invalid UTF-8, which SentencePiece
    # and a byte decoder mark with U+FFFD in different places (the prompt above keeps its byte tokens).
    byte_tokens = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, suppress_tokens=byte_tokens
    )[0]
    # vLLM's text of a continuation: the whole sequence's text past the prompt's (SentencePiece drops only the
    # space the whole text begins with)
    expected = tokenizer.decode(out, skip_special_tokens=True)[
        len(tokenizer.decode(ids[0], skip_special_tokens=True)) :
    ]
    with running_server(make_settings(weights=tmp_path, max_batch=4)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(
            model="mistral",
            prompt=prompt,
            max_tokens=32,
            temperature=0,
            logit_bias={str(t): -100 for t in byte_tokens},
            extra_body={"ignore_eos": True},
        )
    assert answer.usage.prompt_tokens == ids.shape[1]
    assert answer.choices[0].text == expected


PACKED_ROUTES_ONLY = pytest.mark.skipif(
    not packed_linear_wins(),
    reason="the packed linear kernel is used on the avx512 and avx2 routes only (model/kernels/loader.py)",
)


def bfloat16_llama(tmp_path: Path, family: str = "llama"):
    folder = save_folder(tmp_path / f"{family}-bf16", family, dtype=torch.bfloat16)
    return load_model(imported(folder), dtype=torch.bfloat16)[0]


def greedy_rows(rows: int) -> tuple[torch.Tensor, BatchSampling]:
    prompt = torch.tensor([[1, 17, 42, 99, 7], [3, 5, 8, 13, 21], [2, 4, 6, 300, 9]])[:rows]
    return prompt, BatchSampling.from_params([SamplingParams(temperature=0.0)] * rows)


@PACKED_ROUTES_ONLY
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # an untied head (a linear layer), a tied one (SmolLM's)
def test_a_bfloat16_llama_s_packed_twin_draws_its_greedy_tokens(tmp_path, rows, family):
    """The decode twin of a bfloat16 Llama, every linear layer and a tied head packed as bfloat16 (the kernel sums
    in float32 and rounds once, as PyTorch's layer does), decodes the greedy tokens the model does with PyTorch's
    layers."""
    model = bfloat16_llama(tmp_path, family)
    assert load_kernels().ok
    twin = decode_twin(model)
    packed = [m for m in twin.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(m.weight.dtype == torch.bfloat16 for m in packed)
    assert isinstance(twin.head, PackedTiedHead if family == "qwen2" else PackedLinear)
    assert not any(isinstance(m, (PackedLinear, PackedTiedHead)) for m in model.modules())
    prompt, greedy = greedy_rows(rows)
    with torch.inference_mode():
        ours = generate(twin, prompt, prompt.shape[1] + 40, greedy, compiled=False)
        pytorch_s = generate(model, prompt, prompt.shape[1] + 40, greedy, compiled=False)
    assert torch.equal(ours, pytorch_s)


@PACKED_ROUTES_ONLY
def test_a_bfloat16_llama_s_compiled_steps_run_its_packed_twin_to_the_eager_greedy_tokens(tmp_path):
    model = bfloat16_llama(tmp_path)
    prompt, greedy = greedy_rows(1)
    with torch.inference_mode():
        decoder = CompiledDecoder(model, model.new_state(1), one_call=False)
        assert decoder.compile_now().error is None and decoder.compiled
        assert decoder._stepped_model is decode_twin(model)
        compiled = generate(model, prompt, prompt.shape[1] + 40, greedy, decoder=decoder)
        eager = generate(model, prompt, prompt.shape[1] + 40, greedy, compiled=False)
    assert torch.equal(compiled, eager)
