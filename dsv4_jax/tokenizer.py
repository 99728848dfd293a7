"""Text <-> token ids for `dsv4-jax generate --text`, from a checkpoint's Hugging Face `tokenizer.json`.

DeepSeek-V4 checkpoints ship `tokenizer.json` (the `tokenizers` library's format) and `tokenizer_config.json`
(`bos_token`, `eos_token`, `add_bos_token`). The model itself only sees token ids; this module is the thin layer
that turns a text prompt into them and the generated ids back into text:

    tok = load_tokenizer("/path/to/checkpoint")        # or the tokenizer.json file itself
    ids = tok.encode("The capital of France is")       # [bos_id, ...] when the config asks for a BOS token
    text = tok.decode(new_ids)

Invariants: `encode` never returns an empty list (an empty prompt is an error, as for token-id prompts); the BOS
token is prepended at most once (not when the tokenizer's own post-processor already put it first); ids are not
checked against the model's vocabulary here (the engine does, with the prompt's index in its error).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer: `tokenizer` is a `tokenizers.Tokenizer`; bos_id / eos_id are the ids of the config's
    BOS / EOS tokens (None where the config names none or the vocabulary lacks them); add_bos: whether `encode`
    puts BOS first; path: the tokenizer.json it came from."""

    tokenizer: Any
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    path: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """text -> token ids (BOS first where `add_bos`). Raises ValueError for the empty string (no tokens)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=True).ids) if text else []
        if not ids:
            raise ValueError(f"text prompt {text!r} has no tokens")
        if self.add_bos and self.bos_id is not None and ids[0] != self.bos_id:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(int(token_id))


def find_tokenizer_file(path: str) -> str | None:
    """`path` itself if it is a file, else `path/tokenizer.json` if that exists, else None."""
    if os.path.isfile(path):
        return path
    candidate = os.path.join(path, TOKENIZER_FILE)
    return candidate if os.path.isfile(candidate) else None


def _special_token(config: dict, name: str) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...} (AddedToken)."""
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str) -> TextTokenizer:
    """Load `path` (a tokenizer.json file, or a directory holding one, e.g. the checkpoint directory) and the
    tokenizer_config.json beside it, if any. Errors name the path and what is missing."""
    file = find_tokenizer_file(path)
    if file is None:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {path!r}: text prompts need the checkpoint's tokenizer "
                                f"(give --tokenizer FILE_OR_DIR, or token ids with --prompt)")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # a dependency of the package; missing only in a hand-made environment
        raise ImportError("text prompts need the `tokenizers` package: pip install tokenizers") from e
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as e:  # the library raises a bare Exception on a malformed file
        raise ValueError(f"{file} is not a tokenizers-format tokenizer.json: {e}") from e
    config: dict = {}
    config_file = os.path.join(os.path.dirname(file), TOKENIZER_CONFIG_FILE)
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} does not hold a JSON object")

    def token_id(name: str) -> int | None:
        token = _special_token(config, name)
        return None if token is None else tokenizer.token_to_id(token)

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    add_bos = bool(config.get("add_bos_token", False))
    if add_bos and bos_id is None:
        raise ValueError(f"{config_file} sets add_bos_token but its bos_token "
                         f"{_special_token(config, 'bos_token')!r} is not in {file}'s vocabulary")
    return TextTokenizer(tokenizer=tokenizer, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos, path=file)
