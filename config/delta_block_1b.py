exec(open('config/_1b.py').read())
residual = 'delta_block'
out_dir = 'out/delta_block_1b'
wandb_run_name = 'delta_block_1b'
