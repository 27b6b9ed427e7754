"""Test kits for plugin authors: subclass a contract in your plugin's tests."""
