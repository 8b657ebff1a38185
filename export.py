"""
Export a train.py checkpoint to a Hugging Face directory (config.json + model.safetensors, and its
tokenizer as tokenizer.json + tokenizer_config.json), which transformers, checkpoints.load_hf and sample.py load:

    python export.py out/finetune_qwen3_0.6b_delta_block/ckpt exported/qwen3_0.6b_delta_block
(out_dir/ckpt is the latest checkpoint, out_dir/best the best validation loss's).

A 'standard' model becomes a plain Qwen3 checkpoint that transformers' Qwen3ForCausalLM loads. A routed
mode becomes a transformers model with remote code (hf_model.py, model.py and fast_routing.py, copied along):
AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True). See docs/huggingface.md.
"""
import argparse
import importlib.util
import os
import shutil
import tempfile

import torch

from checks import InvalidValue
from checkpoints import load_trained, save_hf
from tokenizer import get_tokenizer, save_hf_tokenizer

NEEDS = ('safetensors', 'tokenizers')   # requirements.txt's; transformers is not needed to write the directory


def export(ckpt_path, dest, dtype=None):
    """Write the directory whole or not at all: into a temporary folder beside dest, renamed to dest when complete."""
    dest = os.path.abspath(dest)
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} exists; export into a new folder (or remove it first)")
    model, tokenizer = load_trained(str(ckpt_path))
    try:    # the run's tokenizer is at hand (a missing tokenizer.json: an error before any write)
        get_tokenizer(tokenizer)
    except RuntimeError as e:
        raise InvalidValue(str(e)) from None
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + '.', suffix='.partial', dir=os.path.dirname(dest))
    try:
        save_hf(model, tmp, dtype)
        save_hf_tokenizer(tokenizer, tmp, model.config.block_size)   # 'byte', 'gpt2' or a tokenizer.json
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('ckpt', help='a train.py checkpoint: out_dir/ckpt or out_dir/best')
    ap.add_argument('dest', help='directory to write (must not exist)')
    ap.add_argument('--dtype', choices=['float32', 'bfloat16'], help='default: as trained (float32 master weights)')
    args = ap.parse_args(argv)
    if missing := [m for m in NEEDS if importlib.util.find_spec(m) is None]:
        raise SystemExit(f"export.py: error: it needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    try:
        model = export(args.ckpt, args.dest, getattr(torch, args.dtype) if args.dtype else None)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        # a bad or missing checkpoint or tokenizer, a folder in the way: its one-line message
        raise SystemExit(f"export.py: error: {e}") from None
    print(f"wrote {args.dest}: {model.config.residual}, {model.get_num_params() / 1e6:.2f}M parameters")


if __name__ == '__main__':
    main()
