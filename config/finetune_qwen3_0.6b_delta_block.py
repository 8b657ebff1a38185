exec(open('config/_finetune_qwen3_0.6b.py').read())
residual = 'delta_block'
res_gate = True                 # zero gates at conversion: step 0 is exactly Qwen3-0.6B
out_dir = 'out/finetune_qwen3_0.6b_delta_block'
wandb_run_name = 'finetune_qwen3_0.6b_delta_block'
