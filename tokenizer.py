"""
Tokenizers: the one place that maps a tokenizer name ('byte', 'gpt2' or a Hugging Face tokenizer.json) to an
encoder, and writes the same tokenizer as files that transformers' AutoTokenizer loads. No torch here:
prepare_fineweb.py and its worker processes import this file.
"""
import base64
import json
import shutil
import tempfile
from pathlib import Path

import tiktoken

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
            raise ValueError(f"tokenizer {path} has no '<|endoftext|>' token to separate documents")

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
            raise FileNotFoundError(f"{path} is a directory without tokenizer.json")
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
    the tiktoken tokenizers ('byte', 'gpt2') are converted by transformers' TikTokenConverter, which
    rebuilds the BPE merges from the ranks (tested: the same ids as tiktoken)."""
    enc = get_tokenizer(name)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if isinstance(enc, HFTokenizer):
        if Path(enc.name).resolve() != (dest / 'tokenizer.json').resolve():
            shutil.copy(enc.name, dest / 'tokenizer.json')
    else:
        from tokenizers import AddedToken
        from transformers.convert_slow_tokenizer import TikTokenConverter
        with tempfile.TemporaryDirectory() as tmp:   # the converter reads tiktoken's file format
            ranks = Path(tmp) / 'ranks.tiktoken'
            ranks.write_text(''.join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in enc._mergeable_ranks.items()))
            tok = TikTokenConverter(str(ranks), pattern=enc._pat_str).converted()
        tok.add_special_tokens([AddedToken(t, special=True) for t in enc._special_tokens])   # appended in order
        if any(tok.token_to_id(t) != i for t, i in enc._special_tokens.items()):
            raise ValueError(f"tokenizer {name!r}: its special tokens {enc._special_tokens} do not follow its ranks, "
                             f"so the converted tokenizer would number them differently")
        tok.save(str(dest / 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|endoftext|>',
              'bos_token': None, 'clean_up_tokenization_spaces': False}
    if model_max_length is not None:
        config['model_max_length'] = model_max_length
    (dest / 'tokenizer_config.json').write_text(json.dumps(config, indent=2) + '\n')
