"""llama.cpp as a peer of the imported-model benchmarks: a Hugging Face folder written as GGUF, and timed decoding.

The GGUF is written here with the `gguf` package (llama.cpp's own converter is not in the llama-cpp-python wheel,
and it refuses a byte-level BPE whose pre-tokenizer it does not know, as the benchmarks' small trained BPE is):
tensor names and metadata as llama.cpp reads them for its `llama` and `gpt2` architectures, and the folder's
BPE vocabulary and merges as a `gpt2`-style tokenizer. The contestant decodes through llama-cpp-python's
low-level batch API: one sequence per row of the batch in one context, every row's next token in one
`llama_decode` call, greedy (argmax of the logits). For the step-time-against-position sweep
(benchmarks/decode_positions.py), `LlamaCppSteps` advances every row's sequence with random tokens and times single
`llama_decode` steps there.
"""

from __future__ import annotations

import ctypes
import json
import time
from pathlib import Path

import numpy as np
import torch

DTYPES = ("f32", "f16", "bf16")  # the GGUF dtypes of the big matrices; norms and biases stay f32, as llama.cpp's do


def available() -> str | None:
    """None when llama-cpp-python and gguf import, else why not (benchmarks/install_peers.sh installs them)."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama.cpp peer not installed ({error}); run benchmarks/install_peers.sh"
    return None


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


# ---------------------------------------------------------------- writing GGUF


def write_gguf(folder: Path, out: Path, dtype: str = "f32") -> Path:
    """The Hugging Face folder's Llama or GPT-2 as a GGUF file llama.cpp loads, big matrices in `dtype`."""
    if dtype not in DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    config = json.loads((folder / "config.json").read_text())
    kind = config["model_type"]
    if kind not in ("llama", "gpt2"):
        raise ValueError(f"model_type {kind!r}: the llama.cpp peer writes only 'llama' and 'gpt2'")
    import gguf

    state = _read_state(folder)
    writer = gguf.GGUFWriter(str(out), kind)
    (_llama_metadata if kind == "llama" else _gpt2_metadata)(writer, config)
    writer.add_file_type({"f32": 0, "f16": 1, "bf16": 32}[dtype])  # LLAMA_FTYPE_ALL_F32 / MOSTLY_F16 / MOSTLY_BF16
    _add_tokenizer(writer, folder, _vocab_size(config))
    tensors = _llama_tensors(state, config) if kind == "llama" else _gpt2_tensors(state, config)
    for name, tensor in tensors:
        _add_tensor(writer, name, tensor, dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state |= {name: t.float() for name, t in load_file(file).items()}
    return state


def _vocab_size(config: dict) -> int:
    return config["vocab_size"]


def _llama_metadata(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])


def _gpt2_metadata(writer, config: dict) -> None:
    writer.add_context_length(config["n_positions"])
    writer.add_embedding_length(config["n_embd"])
    writer.add_block_count(config["n_layer"])
    writer.add_feed_forward_length(config.get("n_inner") or 4 * config["n_embd"])
    writer.add_head_count(config["n_head"])
    writer.add_layer_norm_eps(config["layer_norm_epsilon"])
    writer.add_vocab_size(config["vocab_size"])


def _interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Q or K rows from Hugging Face's rotary layout (halves) to llama.cpp's (pairs): [heads*d, in] -> same shape."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _llama_tensors(state: dict, config: dict):
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if "lm_head.weight" in state and not config.get("tie_word_embeddings", False):
        yield "output.weight", state["lm_head.weight"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"]
        yield f"blk.{i}.attn_q.weight", _interleave_rotary(state[p + "self_attn.q_proj.weight"], heads)
        yield f"blk.{i}.attn_k.weight", _interleave_rotary(state[p + "self_attn.k_proj.weight"], kv_heads)
        yield f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"]
        yield f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"]
        yield f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"]
        yield f"blk.{i}.ffn_gate.weight", state[p + "mlp.gate_proj.weight"]
        yield f"blk.{i}.ffn_up.weight", state[p + "mlp.up_proj.weight"]
        yield f"blk.{i}.ffn_down.weight", state[p + "mlp.down_proj.weight"]


def _gpt2_tensors(state: dict, config: dict):
    def get(name: str) -> torch.Tensor:
        return state[name] if name in state else state["transformer." + name]

    yield "token_embd.weight", get("wte.weight")
    yield "position_embd.weight", get("wpe.weight")
    yield "output_norm.weight", get("ln_f.weight")
    yield "output_norm.bias", get("ln_f.bias")
    yield "output.weight", get("wte.weight")  # GPT-2 ties its head to the embedding
    # Hugging Face's Conv1D keeps weights as [in, out]; GGUF wants [out, in] as a Linear does.
    pairs = [("attn_norm", "ln_1", False), ("attn_qkv", "attn.c_attn", True), ("attn_output", "attn.c_proj", True)]
    pairs += [("ffn_norm", "ln_2", False), ("ffn_up", "mlp.c_fc", True), ("ffn_down", "mlp.c_proj", True)]
    for i in range(config["n_layer"]):
        for ours, theirs, conv in pairs:
            weight = get(f"h.{i}.{theirs}.weight")
            yield f"blk.{i}.{ours}.weight", weight.t().contiguous() if conv else weight
            yield f"blk.{i}.{ours}.bias", get(f"h.{i}.{theirs}.bias")


def _add_tensor(writer, name: str, tensor: torch.Tensor, dtype: str) -> None:
    import gguf

    data = tensor.float().numpy()
    if data.ndim < 2 or dtype == "f32":  # norms and biases stay f32, as llama.cpp's own converter keeps them
        writer.add_tensor(name, data.astype(np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, data.astype(np.float16))
    else:
        raw = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.BF16)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


def _add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The folder's byte-level BPE as llama.cpp's `gpt2` tokenizer, padded to the model's vocabulary size."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # llama.cpp's token types: 1 normal, 3 control, 5 unused
    for text, index in (vocab | specials).items():
        tokens[index], types[index] = text, 3 if text in specials else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config = json.loads((folder / "config.json").read_text())
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    if config.get("eos_token_id") is not None:
        writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)


# ---------------------------------------------------------------- decoding


class LlamaCppDecoder:
    """One llama.cpp context decoding `batch` sequences side by side (its parallel sequences), greedily."""

    def __init__(self, gguf_file: Path, batch: int, context: int, threads: int):
        import llama_cpp

        self.lib, self.batch = llama_cpp, batch
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf_file).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_file}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = batch * context
        params.n_batch = params.n_ubatch = max(batch, 512)
        params.n_seq_max = batch
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.tokens = llama_cpp.llama_batch_init(max(batch, 512), 0, batch)
        # Entries one llama_decode call takes: the context lowers n_batch to a short context's size.
        self.capacity = min(max(batch, 512), llama_cpp.llama_n_batch(self.ctx))

    def close(self) -> None:
        self.lib.llama_batch_free(self.tokens)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def clear(self) -> None:
        """Every sequence emptied from the cache."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def generate(self, prompt: list[int], new_tokens: int) -> torch.Tensor:
        """[batch, new_tokens] greedy tokens, every row from `prompt` (its own sequence in the shared cache)."""
        self.clear()
        last = len(prompt) - 1  # every row's prompt is its own sequence, all of them in one decode call
        self.fill([(t, pos, row, pos == last) for row in range(self.batch) for pos, t in enumerate(prompt)])
        self.decode()
        out = np.empty((self.batch, new_tokens), dtype=np.int64)
        out[:, 0] = self._argmax(self.batch)
        for step in range(1, new_tokens):
            position = len(prompt) + step - 1
            self.fill([(int(out[row, step - 1]), position, row, True) for row in range(self.batch)])
            self.decode()
            out[:, step] = self._argmax(self.batch)
        return torch.from_numpy(out)

    def fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) per entry, into the reusable llama_batch."""
        b = self.tokens
        b.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, position, 1, logits
            b.seq_id[i][0] = sequence

    def decode(self) -> None:
        status = self.lib.llama_decode(self.ctx, self.tokens)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _argmax(self, rows: int) -> np.ndarray:
        logits = self.lib.llama_get_logits(self.ctx)  # the rows that asked for logits, in batch order
        view = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(rows, self.n_vocab))
        return view.argmax(axis=1)


class LlamaCppSteps:
    """llama.cpp in the position sweep (benchmarks/decode_positions.py, `PositionPeer`): every row's sequence
    advanced by prefilling random tokens, then single steps of one token per row, each a `llama_decode` call that
    attends over the row's whole cache and computes every row's logits (as a generating step does)."""

    def __init__(self, gguf_file: Path, batch: int, context: int, threads: int, seed: int = 0):
        self.decoder = LlamaCppDecoder(gguf_file, batch, context, threads)
        self.decoder.clear()
        self.rng = np.random.default_rng(seed)
        self.tokens_in_cache = 0  # per row: every row's sequence holds the same number

    def close(self) -> None:
        self.decoder.close()

    def position(self) -> int:
        return self.tokens_in_cache

    def advance_to(self, position: int) -> None:
        rows = self.decoder.batch
        per_call = max(1, self.decoder.capacity // rows)  # tokens per row in one prefill call
        while self.tokens_in_cache < position:
            n = min(per_call, position - self.tokens_in_cache)
            tokens = self.rng.integers(0, self.decoder.n_vocab, (rows, n))
            start = self.tokens_in_cache
            self.decoder.fill([(int(tokens[r, i]), start + i, r, i == n - 1) for r in range(rows) for i in range(n)])
            self.decoder.decode()
            self.tokens_in_cache += n

    def time_steps(self, steps: int) -> list[float]:
        seconds = []
        for _ in range(steps):
            self.decoder.fill([(0, self.tokens_in_cache, r, True) for r in range(self.decoder.batch)])
            start = time.perf_counter()
            self.decoder.decode()
            seconds.append(time.perf_counter() - start)
            self.tokens_in_cache += 1
        return seconds

    def state_bytes_per_sequence(self) -> int:
        """What llama.cpp would save of one row's sequence (its KV cache cells, f16 by default), in bytes."""
        return int(self.decoder.lib.llama_state_seq_get_size(self.decoder.ctx, 0))


# ---------------------------------------------------------------- contestants of the benchmarks


def gguf_files(folder: Path, out_dir: Path, dtypes: tuple[str, ...]) -> dict[str, Path]:
    """The folder written once per GGUF dtype, into out_dir."""
    return {dtype: write_gguf(folder, out_dir / f"{folder.name}-{dtype}.gguf", dtype) for dtype in dtypes}


def start_token(folder: Path) -> int:
    """The token every row starts from, as the rnnserve and Hugging Face contestants start (bos, else eos)."""
    config = json.loads((folder / "config.json").read_text())
    start = config.get("bos_token_id")
    return config["eos_token_id"] if start is None else start


def peer_contestants(files: dict[str, Path], prompt: list[int], threads: tuple[int, ...] = (1, 2)):
    """A factory for measure_throughput: batch, new_tokens -> {name: (run, row fields, close)}."""

    def make(batch: int, new_tokens: int) -> dict:
        runs = {}
        for dtype, path in files.items():
            for n in threads:
                decoder = LlamaCppDecoder(path, batch, len(prompt) + new_tokens + 1, n)
                fields = {"dtype": dtype, "threads": n, "engine": f"llama-cpp-python {version()}", "greedy": True}
                runs[contestant_name(dtype, n)] = (
                    lambda d=decoder: d.generate(prompt, new_tokens),
                    fields,
                    decoder.close,
                )
        return runs

    return make


def position_peers(
    files: dict[str, Path], batch: int, positions: list[int], steps: int, threads: tuple[int, ...] = (1, 2)
) -> dict[str, LlamaCppSteps]:
    """The sweep's llama.cpp contestants at `batch`: one per GGUF file and thread count, each with a context long
    enough for the last position, its timed steps and the sweep's warm-up."""
    context = max(positions) + steps + 8
    return {
        contestant_name(dtype, n): LlamaCppSteps(path, batch, context, n)
        for dtype, path in files.items()
        for n in threads
    }


def contestant_name(dtype: str, threads: int) -> str:
    """How the benchmarks' rows name llama.cpp on a GGUF dtype and thread count (docs_tables reads them back)."""
    return f"llama.cpp ({dtype} GGUF, {threads} thread{'s' if threads > 1 else ''})"
