"""A tiny converted checkpoint with a real (byte-level BPE) tokenizer, for end-to-end engine tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cbjax.checkpoint.convert import convert_checkpoint
from helpers_hf import make_tiny_hf_model

TINY_VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that spoke in riddles.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Unicode: café, naïve, 東京, emoji 🙂 and numbers 12345.",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_tiny_tokenizer(hf_dir: Path) -> None:
    """Byte-level BPE trained on a small corpus; ids 0-2 are <unk>, <s> (bos), </s> (eos)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    assert tokenizer.get_vocab_size() <= TINY_VOCAB
    tokenizer.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def make_tiny_checkpoint(tmp_path: Path, arch: str = "llama", **overrides) -> tuple[Path, Path]:
    """(hf_dir, converted checkpoint dir) of a random tiny model with a tokenizer."""
    hf_dir = make_tiny_hf_model(tmp_path, arch, vocab_size=TINY_VOCAB, max_position_embeddings=512, **overrides)
    write_tiny_tokenizer(hf_dir)
    return hf_dir, convert_checkpoint(hf_dir, Path(tmp_path) / f"ckpt-{arch}", None)
