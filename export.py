"""
Export a train.py checkpoint to a Hugging Face directory (config.json + model.safetensors, and its
tokenizer as tokenizer.json + tokenizer_config.json), which transformers, GPT.from_qwen3 and sample.py load:

    python export.py out/finetune_qwen3_0.6b_delta_block/ckpt.pt exported/qwen3_0.6b_delta_block

A 'standard' model becomes a plain Qwen3 checkpoint that transformers' Qwen3ForCausalLM loads. A routed
mode becomes a transformers model with remote code (hf_model.py and model.py, copied along):
AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True). See docs/huggingface.md.
"""
import argparse
from pathlib import Path

import torch

from checkpoints import load_model, save_hf_tokenizer


def export(ckpt_path, dest, dtype=None):
    ckpt_path = Path(ckpt_path)
    if ckpt_path.name != 'ckpt.pt':
        raise ValueError(f"{ckpt_path}: expected a train.py checkpoint, out_dir/ckpt.pt")
    model, tokenizer = load_model('resume', str(ckpt_path.parent))
    model.save_qwen3(dest, dtype)
    save_hf_tokenizer(tokenizer, dest, model.config.block_size)   # 'byte', 'gpt2' or a tokenizer.json
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('ckpt', help='out_dir/ckpt.pt written by train.py')
    ap.add_argument('dest', help='directory to write')
    ap.add_argument('--dtype', choices=['float32', 'bfloat16'], help='default: as trained (float32 master weights)')
    args = ap.parse_args(argv)
    model = export(args.ckpt, args.dest, getattr(torch, args.dtype) if args.dtype else None)
    print(f"wrote {args.dest}: {model.config.residual}, {model.get_num_params() / 1e6:.2f}M parameters")


if __name__ == '__main__':
    main()
