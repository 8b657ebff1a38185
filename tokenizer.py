"""
Tokenizers: the one place that maps a tokenizer name ('byte', 'gpt2' or a Hugging Face tokenizer.json) to an
encoder, and writes the same tokenizer as files that transformers' AutoTokenizer loads. No torch here:
prepare_fineweb.py and its worker processes import this file.
"""
import json
import shutil
from pathlib import Path

import tiktoken

from checks import InvalidValue, Missing


class HFTokenizer:
    """A Hugging Face tokenizer.json (e.g. Qwen3's) behind tiktoken's interface, so that data prepared
    for a pretrained checkpoint uses exactly its vocabulary. `name` is the local file: workers and
    sample.py can reopen it without the network."""

    def __init__(self, path):
        from tokenizers import Tokenizer
        self.name = str(path)
        self.tok = Tokenizer.from_file(self.name)
        self.tok.encode_special_tokens = True   # like tiktoken's encode_ordinary: '<|endoftext|>' in a text is text
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = self.tok.token_to_id('<|endoftext|>')
        if self.eot_token is None:
            raise InvalidValue(f"tokenizer {path} has no '<|endoftext|>' token to separate documents")

    def encode_ordinary(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def hf_tokenizer_file(name):
    """A tokenizer.json path, a directory holding one (a checkpoint), or a Hugging Face hub repo such as
    'Qwen/Qwen3-0.6B' (only tokenizer.json is fetched, with huggingface_hub) -> a local file."""
    path = Path(name)
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / 'tokenizer.json').is_file():
            raise Missing(f"{path} is a directory without tokenizer.json")
        return path / 'tokenizer.json'
    from huggingface_hub import hf_hub_download
    try:
        return Path(hf_hub_download(name, 'tokenizer.json'))
    except Exception as e:
        raise RuntimeError(f"tokenizer {name!r} is neither 'byte', 'gpt2', a local tokenizer.json or checkpoint "
                           f"directory, nor a hub repository with a tokenizer.json that could be fetched "
                           f"({type(e).__name__}: {e})") from e


def get_tokenizer(name):
    """The one place that maps a tokenizer name to an encoder (anything with encode_ordinary, decode,
    eot_token, n_vocab and name): 'byte', 'gpt2', or a Hugging Face tokenizer.json (see
    hf_tokenizer_file). Add new tokenizers here."""
    if name == 'byte':
        # 256 byte tokens + <|endoftext|>: tiktoken builds it from the ranks alone, nothing to download.
        # With no merges, byte-level BPE is the identity on bytes, so any text (any language, any code)
        # is encodable; the price is ~4x more tokens than GPT-2's BPE for English.
        return tiktoken.Encoding(
            name='byte',
            pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
            mergeable_ranks={bytes([i]): i for i in range(256)},
            special_tokens={'<|endoftext|>': 256},
        )
    if name == 'gpt2':
        try:
            return tiktoken.get_encoding('gpt2')
        except Exception as e:
            raise RuntimeError(
                f"could not fetch the GPT-2 BPE files for tiktoken ({type(e).__name__}: {e}). tiktoken "
                f"downloads them once from openaipublic.blob.core.windows.net and caches them in "
                f"$TIKTOKEN_CACHE_DIR. Offline options: `--demo` (the Python standard library with the byte "
                f"tokenizer), or your own files with `--local FILE... --tokenizer=byte`; or copy a tiktoken "
                f"cache from a machine with network access into $TIKTOKEN_CACHE_DIR.") from e
    return HFTokenizer(hf_tokenizer_file(name))


def save_hf_tokenizer(name, dest, model_max_length=None):
    """Write tokenizer `name` (see get_tokenizer) into dest as tokenizer.json + tokenizer_config.json,
    which transformers' AutoTokenizer (and so lm-evaluation-harness) loads. A tokenizer.json is copied;
    the tiktoken tokenizers ('byte', 'gpt2') are converted with the `tokenizers` library alone."""
    enc = get_tokenizer(name)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if isinstance(enc, HFTokenizer):
        if Path(enc.name).resolve() != (dest / 'tokenizer.json').resolve():
            shutil.copy(enc.name, dest / 'tokenizer.json')
    else:
        tiktoken_as_hf(enc).save(str(dest / 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>',
              'bos_token': None, 'clean_up_tokenization_spaces': False}
    if model_max_length is not None:
        config['model_max_length'] = model_max_length
    (dest / 'tokenizer_config.json').write_text(json.dumps(config, indent=2) + '\n')


def tiktoken_as_hf(enc):
    """A tiktoken byte-level BPE as a `tokenizers` Tokenizer with the same ids. tokenizers' byte-level BPE spells
    each byte as a printable character (GPT-2's table, below) and needs a list of merges, which tiktoken keeps only
    implicitly: it merges any adjacent pair whose concatenation is a token, the lowest-ranked first. So every split
    of a token into two tokens is a merge, ordered by the rank of the token they make."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    ranks = enc._mergeable_ranks
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    others = [b for b in range(256) if b not in printable]    # spelled as the characters from 256 on, in order
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    spell = lambda token: ''.join(char[b] for b in token)
    splits = sorted((rank, ranks[t[:i]], ranks[t[i:]], t[:i], t[i:]) for t, rank in ranks.items()
                    for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks)
    merges = [(spell(a), spell(b)) for *_, a, b in splits]
    tok = Tokenizer(models.BPE({spell(t): r for t, r in ranks.items()}, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(enc._pat_str), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in enc._special_tokens])
    if any(tok.token_to_id(t) != i for t, i in enc._special_tokens.items()):
        raise InvalidValue(f"tokenizer {enc.name!r}: its special tokens {enc._special_tokens} do not follow its ranks, "
                         f"so the converted tokenizer would number them differently")
    return tok
