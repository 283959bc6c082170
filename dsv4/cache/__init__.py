"""dsv4.cache"""
