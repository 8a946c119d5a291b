"""regent.orchestrate"""
