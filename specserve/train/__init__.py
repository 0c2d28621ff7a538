"""Training an EAGLE-3 draft head inside the engine (`specserve train-head`).

data.py       prompts (ShareGPT first turns) and the target's own answers, regenerated through
              specserve and cached under the output folder
vocab.py      the draft vocabulary (most frequent answer tokens) and its d2t / t2d maps
capture.py    the target's aux hidden states and logits for whole sequences (one prefill each)
ttt.py        the training-time-test unroll and its losses
trainer.py    the loop: batches, optimizer, resumable checkpoints, progress bars
calibrate.py  per-position temperature scaling of the confidences, calibration error
evaluate.py   held-out chain drafting: acceptance per position, tokens per step for k = 1..7
pipeline.py   the whole job: data, vocabulary, training, evaluation, the head folder, report
cli.py        the `train-head` subcommand (its parser imports nothing heavy)
errors.py     TrainHeadError: a user error, shown as one line
"""
