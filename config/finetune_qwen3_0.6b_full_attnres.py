exec(open('config/_finetune_qwen3_0.6b.py').read())
residual = 'full_attnres'
# (a replacement mode has no exact conversion: it starts from uniform routing, see README)
out_dir = 'out/finetune_qwen3_0.6b_full_attnres'
wandb_run_name = 'finetune_qwen3_0.6b_full_attnres'
