"""`dsv4_jax.tokenizer` and `dsv4-jax generate --text`: a small word-level tokenizer.json (built here with the
`tokenizers` library, ids inside the embedded model's 256-token vocabulary) beside a tokenizer_config.json naming
BOS / EOS, as a DeepSeek checkpoint ships them."""

import json
import re

import pytest

from dsv4_jax import cli
from dsv4_jax.tokenizer import load_tokenizer

WORDS = ["the", "capital", "of", "france", "is", "paris", "a", "city", "and", "river"]
VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(WORDS)}}


def write_tokenizer(directory, config=None, post_bos=False, vocab=VOCAB):
    """tokenizer.json (word level over `vocab`, whitespace split; post_bos: its post-processor puts <s> first
    itself) and, unless config is False, tokenizer_config.json (default: add_bos_token with <s>, eos </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.add_special_tokens([t for t in ("<s>", "</s>") if t in vocab])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not False:
        cfg = config if config is not None else {"add_bos_token": True, "bos_token": {"content": "<s>"},
                                                 "eos_token": "</s>"}
        (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return directory


@pytest.mark.parametrize("post_bos", [False, True])
def test_encode_decode_and_special_tokens(tmp_path, post_bos):
    tok = load_tokenizer(str(write_tokenizer(tmp_path, post_bos=post_bos)))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)
    ids = tok.encode("the capital of france is")
    assert ids == [1, 3, 4, 5, 6, 7]            # BOS once, whether or not the post-processor added it
    assert tok.decode([8, 2]) == "paris"        # special tokens skipped
    assert tok.decode([8, 2], skip_special_tokens=False) == "paris </s>"
    assert tok.encode("atlantis")[-1] == 0      # unknown word -> <unk>
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).path == tok.path   # the file itself works too
    with pytest.raises(ValueError, match="no tokens"):
        tok.encode("")


def test_config_variants_and_errors(tmp_path):
    plain = load_tokenizer(str(write_tokenizer(tmp_path / "plain", config=False)))
    assert (plain.bos_id, plain.eos_id, plain.add_bos) == (None, None, False)
    assert plain.encode("a city") == [9, 10]
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path / "nowhere"))
    write_tokenizer(tmp_path / "badbos", config={"add_bos_token": True, "bos_token": "<bos>"})
    with pytest.raises(ValueError, match="bos_token '<bos>' is not in"):
        load_tokenizer(str(tmp_path / "badbos"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers-format"):
        load_tokenizer(str(tmp_path / "broken"))


def test_generate_text_prompts(tmp_path, capsys):
    """--text with --tokenizer: the prompts' ids are the tokenizer's, the new tokens are those of the same ids given
    with --prompt (greedy, EOS off on both), and the continuation is printed as text."""
    write_tokenizer(tmp_path)
    common = ["--max-new-tokens", "5", "--warmup", "0", "--eos-id", "none"]
    assert cli.main(["generate", "--tokenizer", str(tmp_path), "--text", "the capital of france is",
                     "--text", "a river", *common]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tokenizer: .*tokenizer\.json \(13 tokens; model vocab_size 256\); bos 1, stop at eos: none$",
                     out, re.M)
    assert "[0] prompt text: 'the capital of france is'" in out
    assert "[0] prompt (6 tokens): 1 3 4 5 6 7" in out and "[1] prompt (3 tokens): 1 9 12" in out
    new = [[int(t) for t in m.split()] for m in re.findall(r"^\[\d\] new tokens \(5\): (.*)$", out, re.M)]
    texts = re.findall(r"^\[\d\] new text: (.*)$", out, re.M)
    tok = load_tokenizer(str(tmp_path))
    assert texts == [repr(tok.decode(t)) for t in new]
    assert cli.main(["generate", "--prompt", "1 3 4 5 6 7", "--prompt", "1 9 12", *common]) == 0
    out_ids = capsys.readouterr().out
    assert [[int(t) for t in m.split()] for m in re.findall(r"^\[\d\] new tokens \(5\): (.*)$", out_ids, re.M)] == new
    assert "new text" not in out_ids


def test_generate_text_stops_at_the_tokenizers_eos(tmp_path, capsys):
    """Without --eos-id, --text stops at the tokenizer's EOS: a tokenizer whose eos_token is the id the model
    greedily emits first ends every row after one token."""
    write_tokenizer(tmp_path / "t")
    assert cli.main(["generate", "--tokenizer", str(tmp_path / "t"), "--text", "a city", "--max-new-tokens", "1",
                     "--warmup", "0"]) == 0
    first = int(re.search(r"^\[0\] new tokens \(1\): (\d+)$", capsys.readouterr().out, re.M).group(1))
    assert first not in (1, 9, 10), "the prompt's own ids (<s> a city) must keep their words below"
    vocab = {w: i for w, i in VOCAB.items() if i != first}
    word = f"tok{first}"
    vocab[word] = first   # the model's first token, now the EOS
    write_tokenizer(tmp_path / "e", config={"add_bos_token": True, "bos_token": "<s>", "eos_token": word}, vocab=vocab)
    assert cli.main(["generate", "--tokenizer", str(tmp_path / "e"), "--text", "a city", "--max-new-tokens", "6",
                     "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert f"stop at eos: {first} ('{word}', tokenizer_config.json)" in out
    assert re.search(rf"^\[0\] new tokens \(1\): {first}$", out, re.M)


def test_generate_text_eos_from_the_model_config(tmp_path, capsys):
    """A tokenizer.json without tokenizer_config.json: no BOS added, and the rows stop at config.json's
    eos_token_id (the embedded model's is 1)."""
    write_tokenizer(tmp_path, config=False)
    assert cli.main(["generate", "--tokenizer", str(tmp_path), "--text", "a city", "--max-new-tokens", "2",
                     "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "bos not added, stop at eos: 1 ('<s>', config.json)" in out
    assert "[0] prompt (2 tokens): 9 10" in out


def test_generate_text_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no tokenizer.json"):   # the embedded checkpoint ships none
        cli.main(["generate", "--text", "hello"])
    with pytest.raises(SystemExit):                              # argparse: one kind of prompt
        cli.main(["generate", "--text", "hello", "--prompt", "1 2"])
    with pytest.raises(SystemExit, match="--tokenizer applies to --text"):
        cli.main(["generate", "--prompt", "1 2", "--tokenizer", str(tmp_path)])
    with pytest.raises(SystemExit):                              # argparse: not an id
        cli.main(["generate", "--prompt", "1", "--eos-id", "end"])
    write_tokenizer(tmp_path, config=False, vocab={**VOCAB, "huge": 300})
    with pytest.raises(SystemExit, match="outside"):            # an id past the model's vocabulary
        cli.main(["generate", "--tokenizer", str(tmp_path), "--text", "huge city", "--max-new-tokens", "2"])
    with pytest.raises(SystemExit, match="no tokens"):
        cli.main(["generate", "--tokenizer", str(tmp_path), "--text", ""])
