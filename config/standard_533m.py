exec(open('config/_533m.py').read())
residual = 'standard'
out_dir = 'out/standard_533m'
wandb_run_name = 'standard_533m'
