"""Population-based training (PBT and PB2): a population of runs trained side by side in rounds; at each
round's boundary the worst copy the exact checkpoint of the best and explore new hyperparameters
(runner/search/pbt/population.py coordinates, member.py runs one member's round, launcher.py hands
members to the Hydra launcher the user chose, explore.py proposes)."""
