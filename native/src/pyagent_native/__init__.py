"""pyagent-native: the C++17 native core of pyagent-framework.

The compiled module is ``pyagent_native._core``; the plugin registers its entries only
when that module imports (see :mod:`pyagent_native.plugin`).
"""
