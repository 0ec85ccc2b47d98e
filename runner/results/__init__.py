"""What comes after training: evaluating, predicting and exporting a trained run, reproducing it from
its MLflow record, and comparing runs."""
