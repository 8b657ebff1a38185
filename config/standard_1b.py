exec(open('config/_1b.py').read())
residual = 'standard'
out_dir = 'out/standard_1b'
wandb_run_name = 'standard_1b'
