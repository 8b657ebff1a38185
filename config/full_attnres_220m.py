exec(open('config/_220m.py').read())
residual = 'full_attnres'
out_dir = 'out/full_attnres_220m'
wandb_run_name = 'full_attnres_220m'
