exec(open('config/_220m.py').read())
residual = 'delta_block'
out_dir = 'out/delta_block_220m'
wandb_run_name = 'delta_block_220m'
