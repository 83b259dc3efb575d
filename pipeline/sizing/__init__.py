"""What a model costs: its shape and parameter counts (``shapes``, read from a config without
loading weights) and the activation and logits memory of training it (``activation_memory``);
make plan and the stages' memory checks read both."""
