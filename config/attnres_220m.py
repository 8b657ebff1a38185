exec(open('config/_220m.py').read())
residual = 'attnres'
out_dir = 'out/attnres_220m'
wandb_run_name = 'attnres_220m'
