"""What users of PyTorch Lightning's Trainer and Hugging Face's TrainingArguments type, and runner's key for it:
the hint an unknown key gets before the closest spelling (which, for these names, points somewhere wrong:
Lightning's accumulate_grad_batches is nearest to max_eval_batches)."""
from __future__ import annotations

# the peer's name (the last part of what was typed) -> (whose, what runner calls it)
PEER_NAMES: dict[str, tuple[str, str]] = {
    # Lightning's Trainer
    "accumulate_grad_batches": ("Lightning", "+accum=N (accumulation.steps)"),
    "gradient_clip_val": ("Lightning", "trainer.clip_grad_norm (trainer.clip_grad_value with gradient_clip_algorithm=value)"),
    "gradient_clip_algorithm": ("Lightning", "trainer.clip_grad_norm or trainer.clip_grad_value"),
    "precision": ("Lightning", "precision group: precision=bf16 (bf16-mixed), fp16 (16-mixed), bf16_true, fp32, tf32 or fp8"),
    "fast_dev_run": ("Lightning", "debug=fast"),
    "max_epochs": ("Lightning", "trainer.max_epochs"),
    "max_steps": ("Lightning", "trainer.max_steps"),
    "devices": ("Lightning", "parallelism.nproc_per_node (with parallelism=ddp or fsdp)"),
    "num_nodes": ("Lightning", "parallelism.nnodes"),
    "strategy": ("Lightning", "parallelism group: parallelism=ddp, fsdp or hsdp"),
    "accelerator": ("Lightning", "trainer.device"),
    "logger": ("Lightning", "tracking group: tracking=mlflow or none (tracking.uri, tracking.experiment)"),
    "val_check_interval": ("Lightning", "trainer.eval_every_n_steps"),
    "check_val_every_n_epoch": ("Lightning", "trainer.eval_every_epoch"),
    "limit_train_batches": ("Lightning", "trainer.limit_train"),
    "limit_val_batches": ("Lightning", "trainer.limit_val"),
    "limit_test_batches": ("Lightning", "trainer.limit_test"),
    "overfit_batches": ("Lightning", "trainer.overfit_batches"),
    "detect_anomaly": ("Lightning", "trainer.detect_anomaly"),
    "deterministic": ("Lightning", "trainer.deterministic"),
    "benchmark": ("Lightning", "trainer.deterministic=false"),
    "ckpt_path": ("Lightning", "trainer.resume"),
    "default_root_dir": ("Lightning", "hydra.run.dir"),
    "enable_checkpointing": ("Lightning", "trainer.save_checkpoints"),
    "enable_progress_bar": ("Lightning", "trainer.progress_bar"),
    "sync_batchnorm": ("Lightning", "parallelism.sync_batchnorm"),
    "profiler": ("Lightning", "trainer.profile=true (or debug=profile)"),
    "auto_lr_find": ("Lightning", "tune=lr_find"),
    "auto_scale_batch_size": ("Lightning", "tune=batch_size"),
    # Hugging Face's TrainingArguments
    "learning_rate": ("HF Trainer", "optimizer.lr"),
    "lr": ("PyTorch", "optimizer.lr"),
    "weight_decay": ("HF Trainer", "optimizer.weight_decay"),
    "num_train_epochs": ("HF Trainer", "trainer.max_epochs"),
    "per_device_train_batch_size": ("HF Trainer", "dataset.batch_size (per process)"),
    "per_device_eval_batch_size": ("HF Trainer", "dataset.batch_size (one batch size for training and evaluation)"),
    "batch_size": ("PyTorch", "dataset.batch_size"),
    "gradient_accumulation_steps": ("HF Trainer", "+accum=N (accumulation.steps)"),
    "max_grad_norm": ("HF Trainer", "trainer.clip_grad_norm"),
    "bf16": ("HF Trainer", "precision=bf16"),
    "fp16": ("HF Trainer", "precision=fp16"),
    "tf32": ("HF Trainer", "precision=tf32"),
    "lr_scheduler_type": ("HF Trainer", "scheduler group: scheduler=cosine, warmup_cosine, constant, ..."),
    "warmup_steps": ("HF Trainer", "scheduler=warmup_cosine with scheduler.warmup"),
    "warmup_ratio": ("HF Trainer", "scheduler=warmup_cosine with scheduler.warmup"),
    "eval_steps": ("HF Trainer", "trainer.eval_every_n_steps"),
    "save_steps": ("HF Trainer", "trainer.checkpoint_every_n_steps"),
    "save_total_limit": ("HF Trainer", "trainer.keep_checkpoints"),
    "logging_steps": ("HF Trainer", "trainer.log_every_n_steps"),
    "output_dir": ("HF Trainer", "hydra.run.dir"),
    "resume_from_checkpoint": ("HF Trainer", "trainer.resume"),
    "gradient_checkpointing": ("HF Trainer", "trainer.activation_checkpointing"),
    "torch_compile": ("HF Trainer", "trainer.compile"),
    "load_best_model_at_end": ("HF Trainer", "trainer.test_on=best"),
    "metric_for_best_model": ("HF Trainer", "objective.metric"),
    "greater_is_better": ("HF Trainer", "objective.direction"),
    "early_stopping_patience": ("HF Trainer", "trainer.early_stopping.patience"),
    "report_to": ("HF Trainer", "tracking group: tracking=mlflow or none"),
    "dataloader_num_workers": ("HF Trainer", "dataset.num_workers"),
    "optim": ("HF Trainer", "optimizer group: optimizer=adamw, sgd, lamb, ..."),
}


# peer names that are a group of settings in the peer's API, so that a key under them is typed too
GROUP_NAMES = ("logger",)


def peer_hint(key: str) -> str:
    """'Lightning's X is runner's Y; ' for a peer's name typed as a key, else ''."""
    leaf = key.rsplit(".", 1)[-1]
    found = PEER_NAMES.get(leaf)
    if found is None and key.split(".")[0] in GROUP_NAMES:  # logger.name=...: the peer's group, a key of it typed
        leaf = key.split(".")[0]
        found = PEER_NAMES[leaf]
    if found is None:
        return ""
    whose, ours = found
    return f"{whose}'s {leaf} is runner's {ours}; "


# Lightning's precision strings -> runner's precision option
PEER_OPTIONS: dict[tuple[str, str], str] = {
    ("precision", "16-mixed"): "fp16", ("precision", "16"): "fp16", ("precision", "bf16-mixed"): "bf16",
    ("precision", "bf16-true"): "bf16_true", ("precision", "32-true"): "fp32", ("precision", "32"): "fp32",
    ("precision", "transformer-engine"): "fp8", ("parallelism", "dp"): "ddp", ("parallelism", "ddp_spawn"): "ddp",
    ("parallelism", "fsdp2"): "fsdp", ("parallelism", "hybrid_shard"): "hsdp",
}


def peer_option_hint(group: str, option: str) -> str:
    """'Lightning's precision=16-mixed is runner's precision=fp16; ' for a peer's option value, else ''."""
    ours = PEER_OPTIONS.get((group, str(option)))
    theirs = {"parallelism": "strategy"}.get(group, group)  # Lightning's Trainer argument
    return f"Lightning's {theirs}={option} is runner's {group}={ours}; " if ours else ""
