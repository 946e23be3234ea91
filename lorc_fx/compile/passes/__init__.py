"""The graph passes, one file each; ``lorc_fx.compile.pass_manager`` owns their order."""
