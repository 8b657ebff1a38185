exec(open('config/_8b.py').read())
residual = 'standard'
out_dir = 'out/standard_8b'
wandb_run_name = 'standard_8b'
