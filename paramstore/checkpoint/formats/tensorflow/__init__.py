"""Reading TensorFlow and Keras checkpoints, parsed in Python."""
