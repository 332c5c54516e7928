"""Make the tiny model the vLLM tests and demos run: no hub, deterministic.

    python -m clients.vllm.tiny_model OUT_DIR     # prints OUT_DIR when done

A 2-layer Llama (hidden 256, 4 attention heads, 2 KV heads of 64, vocabulary
1,024, context 8,192 tokens) with seeded random bf16 weights, and a byte-level
BPE tokenizer trained here on a few built-in sentences, so every string
round-trips and every id the model can emit decodes. The KV cache is 1 KiB per
token (2 layers x K and V x 2 heads x 64 x bf16); with tensor parallelism 2
each rank holds one KV head.

Greedy decoding of random weights is deterministic, so "same tokens as a
single engine" is a real comparison, and noise in the KV changes the output.

Needs torch, transformers and tokenizers (all in the vLLM venv). Idempotent:
a directory holding a complete model of this recipe is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1024
MAX_MODEL_LEN = 8192
SEED = 20260
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_SIZE = 64

CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_CORPUS = (
    "A coordinator keeps an advisory inventory of which engine retains which block.",
    "Prefill engines compute the KV cache of a prompt; decode engines generate tokens.",
    "A lease pins source blocks while a transfer runs, until every part is quiet.",
    "The system prompt is shared by many conversations, turn after turn.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: , . ; ! ? ( ) [ ] { } - + = / *",
    "User: what is the capital of France? Assistant: the capital of France is Paris.",
)
_SPECIAL = ["<s>", "</s>", "<pad>"]
_STAMP = "kvrc-tiny-model.json"


def recipe_digest() -> str:
    """Changes when anything that shapes the model files changes."""
    data = json.dumps(
        {"config": CONFIG, "corpus": _CORPUS, "seed": SEED, "special": _SPECIAL}, sort_keys=True
    )
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def is_complete(out: Path) -> bool:
    stamp = out / _STAMP
    try:
        return bool(json.loads(stamp.read_text()).get("recipe") == recipe_digest())
    except (OSError, ValueError):
        return False


def _tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found]

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 64,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 16, trainer=trainer)
    # Fill the vocabulary: every id the random model may sample must decode.
    missing = VOCAB_SIZE - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<t{i}>" for i in range(missing)])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {VOCAB_SIZE}")
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = MAX_MODEL_LEN
    fast.save_pretrained(str(out))
    return {name: int(tok.token_to_id(name)) for name in _SPECIAL}


def make_tiny_model(out_dir: str | os.PathLike[str]) -> Path:
    """Write the model into `out_dir` (created) unless it is already there; return it."""
    out = Path(out_dir)
    if is_complete(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found]

    ids = _tokenizer(out)
    config = LlamaConfig(
        **CONFIG,
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
        pad_token_id=ids["<pad>"],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / _STAMP).write_text(json.dumps({"recipe": recipe_digest(), "config": CONFIG}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m clients.vllm.tiny_model OUT_DIR", file=sys.stderr)
        return 2
    print(make_tiny_model(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
