"""The elastic trainer that runs under torchrun inside the training image.

It depends only on ``training/requirements.txt`` and never imports CDK.
"""
