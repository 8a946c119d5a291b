"""regent.jobs"""
