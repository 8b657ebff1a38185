exec(open('config/_533m.py').read())
residual = 'delta_block'
out_dir = 'out/delta_block_533m'
wandb_run_name = 'delta_block_533m'
