select distinct o_status from {{ source('shop', 'orders') }}
