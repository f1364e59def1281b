"""Sampling in the training loop: a step's prompts sampled into completions (`rollout`), scored by reward functions
(`rewards`) and reward models (`model_reward`), with tools and multi-turn agents (`tools`, `tool_worker`, `agent`),
sampled ahead of the learner (`lagged`). Above `jaxtune.train` (it builds the batches a train step takes)."""
