"""Pipeline parallelism: `stages.py` splits the model into stages and places them on ranks, `model.py` runs the
schedules over this rank's stages (`PipelineParallelModel`), `sharded_stage.py` is the torch stage that keeps
FSDP blocks sharded between micro-batches."""
