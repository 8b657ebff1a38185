exec(open('config/_finetune_qwen3_0.6b.py').read())
residual = 'standard'
# (the baseline: plain fine-tuning with the same recipe)
out_dir = 'out/finetune_qwen3_0.6b_standard'
wandb_run_name = 'finetune_qwen3_0.6b_standard'
