"""Reusable CDK constructs, each doing one thing and taking a typed props object.

(Not named ``constructs``: that would shadow the library every CDK module imports.)
"""
