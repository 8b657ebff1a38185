exec(open('config/_220m.py').read())
residual = 'standard'
out_dir = 'out/standard_220m'
wandb_run_name = 'standard_220m'
