"""runner's population-based training sweeper: `python -m runner -m hparams_search=digits_pbt`
(or `hydra/sweeper=pbt`). The population itself is runner's (runner/search/pbt/): it needs runner's exact
checkpoints. This package only registers the config and hands the composed config over."""
