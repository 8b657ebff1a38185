exec(open('config/_8b.py').read())
residual = 'delta_block'
out_dir = 'out/delta_block_8b'
wandb_run_name = 'delta_block_8b'
